"""Kernels per decode step and the graph replay they cost, fused against unfused, one run.

Question (issue 10, item 3): the SmolLM2-135M shape is launch-bound at batch 1
(~1 ms of graph replay for a 0.06 ms weight read). How many kernels does one
decode forward launch, which, and what does the fused rope + KV-cache write
(`vllm/v1/attention/ops/rope_and_cache.py`) and the norm / SiLU-and-mul fused
into the projections after them (`vllm/model_executor/layers/fused_linear.py`)
save against the separate kernels?

    python benchmarks/benchmark_decode_kernels.py --shapes smollm2 llama3_8b \
        --batch-sizes 1 32 --out benchmarks/results/decode_kernels.json

For each shape (random weights, bf16) and batch: the model (`LlamaForCausalLM`)
with one paged KV cache per layer, a decode batch whose requests each hold
`--context` cached tokens, `max_seq_len` = `--max-model-len` as in the
engine's captured graphs. Per variant ("default": the code as it runs, i.e.
rope + KV write fused and, at one row, the norm / SiLU as the GEMV's prologue;
"fused": also the 2..16-row tl.dot projection fusion switched on
(FUSED_LINEAR_MAX_TOKENS = 16; off by default, see `layers/fused_linear.py`);
"rope_cache_only": no projection fusion at any row count; "unfused": also with
`AttentionImpl.forward_with_rope`'s two-launch default):
  kernels_per_step   CUDA kernels of one eager forward + compute_logits
                     (torch.profiler, CUPTI), and by name (`kernels`)
  graph_replay_ms    that forward + compute_logits captured as one CUDA graph,
                     mean of 50 replays between CUDA events (sampling, input
                     preparation and host work of an engine step excluded)
  weight_limit_ms    weight bytes / measured copy bandwidth (the floor)
Then default_over_unfused and fused_over_unfused = replay ratios, and kernels_saved
per step (default against unfused).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import math

import torch
from common import SHAPES, copy_bandwidth_bytes_per_s, emit

from vllm.benchmarks.utils import positive_int

BLOCK_SIZE = 16


def _build(shape: str, batch: int, context: int, max_model_len: int):
    """Model, inputs and attention metadata of a decode step; the caches bound to the layers."""
    from vllm.attention.layer import Attention
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.attention.backends.abstract import AttentionMetadata

    config = SHAPES[shape]()
    torch.manual_seed(0)
    with torch.device("cuda"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    blocks_per_req = math.ceil((context + 1) / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req + 1
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in attn_layers:
        layer.kv_cache = torch.zeros(
            num_blocks, 2, BLOCK_SIZE, layer.num_kv_heads, layer.head_size,
            dtype=torch.bfloat16, device="cuda",
        )
    table = torch.arange(1, num_blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    slots = (table[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE)
    meta = AttentionMetadata(
        num_actual_tokens=batch, max_query_len=1, query_start_loc=starts.cuda(),
        max_seq_len=max_model_len, seq_lens=seq_lens.cuda(), block_table=table,
        slot_mapping=slots.contiguous(), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    input_ids = torch.randint(0, config.vocab_size, (batch,), device="cuda")
    positions = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, input_ids, positions, meta, weight_bytes


def _step(model, input_ids, positions):
    return model.compute_logits(model(input_ids, positions))


def _kernels(fn) -> list[str]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


def _replay_ms(fn, reps: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / reps


VARIANTS = ("default", "fused", "rope_cache_only", "unfused")


@contextlib.contextmanager
def _variant(name: str):
    """The engine's default ("default"), plus the tl.dot projection fusion ("fused"),
    the rope + KV-write fusion alone ("rope_cache_only"), or neither ("unfused")."""
    from vllm.model_executor.layers import fused_linear
    from vllm.v1.attention.backends.abstract import AttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    rope_fused = TritonAttentionImpl.forward_with_rope
    max_tokens = fused_linear.FUSED_LINEAR_MAX_TOKENS
    gemv_bytes = fused_linear.FUSED_GEMV_MAX_WEIGHT_BYTES
    from vllm.model_executor.layers.ops.norm_linear import MAX_ROWS

    fused_linear.FUSED_LINEAR_MAX_TOKENS = MAX_ROWS if name == "fused" else 0
    if name in ("rope_cache_only", "unfused"):
        fused_linear.FUSED_GEMV_MAX_WEIGHT_BYTES = 0
    if name == "unfused":
        TritonAttentionImpl.forward_with_rope = AttentionImpl.forward_with_rope
    try:
        yield
    finally:
        TritonAttentionImpl.forward_with_rope = rope_fused
        fused_linear.FUSED_LINEAR_MAX_TOKENS = max_tokens
        fused_linear.FUSED_GEMV_MAX_WEIGHT_BYTES = gemv_bytes


def bench(shape: str, batch: int, context: int, max_model_len: int, copy_bps: float) -> dict:
    from vllm.forward_context import set_forward_context

    model, input_ids, positions, meta, weight_bytes = _build(shape, batch, context, max_model_len)
    row = {"shape": shape, "batch": batch, "context": context,
           "weight_limit_ms": weight_bytes / copy_bps * 1e3}
    step = functools.partial(_step, model, input_ids, positions)
    with torch.inference_mode(), set_forward_context(meta):
        for name in VARIANTS:
            with _variant(name):
                step()  # compile
                torch.cuda.synchronize()
                names = _kernels(step)
                row[name] = {
                    "kernels_per_step": len(names),
                    "kernels": dict(collections.Counter(n[:80] for n in names).most_common()),
                    "graph_replay_ms": _replay_ms(step),
                }
    row["kernels_saved"] = row["unfused"]["kernels_per_step"] - row["default"]["kernels_per_step"]
    for name in ("default", "fused"):
        row[f"{name}_over_unfused"] = (row[name]["graph_replay_ms"]
                                       / row["unfused"]["graph_replay_ms"])
    del model, step
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama3_8b"],
                        choices=list(SHAPES), help="model shapes (random weights, bf16)")
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 32],
                        help="decode batch sizes (requests per step)")
    parser.add_argument("--context", type=positive_int, default=256,
                        help="cached tokens per request")
    parser.add_argument("--max-model-len", type=positive_int, default=8192,
                        help="max_seq_len the attention is built for, as in the engine's "
                             "captured graphs")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "benchmark_decode_kernels: needs a CUDA GPU; nothing measured\n")
    copy_bps = copy_bandwidth_bytes_per_s()
    rows = [bench(s, b, args.context, args.max_model_len, copy_bps)
            for s in args.shapes for b in args.batch_sizes]
    emit({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bps,
          "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
