"""Decode attention as the engine's decode CUDA graph runs it, by kernel variant.

Question: how long does one layer's decode attention (plus the split-KV reduce)
take inside a graph captured at the engine's bounds (max_query_len 1,
max_seq_len = max_model_len) and replayed with the short contexts of real
traffic, and how close is that to reading the KV bytes at copy bandwidth?

    python benchmarks/benchmark_decode_attention.py [--out FILE] [--layers 32]
        [--baseline-module PATH]   # an older unified_attention.py to A/B against, e.g.
                                   # git show 1308477:vllm/v1/attention/ops/unified_attention.py
    python benchmarks/benchmark_decode_attention.py --sweep   # tiles x stages x split policy
    TRITON_INTERPRET=1 python benchmarks/benchmark_decode_attention.py --smoke

For each point (model heads, batch, context range, graph bound) one CUDA graph
holds `--layers` launches, each on its own layer's cache (as the model's
layers are), and is replayed 50 times; time = event time / replays / layers.
Variants (all through `unified_attention`, so the reduce launch is included):

  auto          the launcher's own choice (what the engine runs)
  search        the q-block search path (two loops, 3 stages), every split taking a
                share of even a short range: close to the kernel before decode
                programs existed (--baseline-module times the exact older one)
  decode_min1   one request per program, splits of >= 1 tile
  min_tokens    auto's tiles and splits, each split >= MIN_TOKENS_PER_SPLIT keys
  one_split     auto's tiles with a single split (no reduce launch)
  baseline      --baseline-module's launcher with its own choice

ideal_us = the KV bytes of the batch / the copy bandwidth measured in the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass, replace

import torch
from benchmark_decode_primitives import graph_us
from common import add_smoke_flag, copy_bandwidth, emit, no_gpu_message, smoke_env_problem

from vllm.benchmarks.utils import positive_int


@dataclass(frozen=True)
class Point:
    heads: tuple[int, int, int]  # num_heads, num_kv_heads, head_size
    batch: int
    context: tuple[int, int]  # seq lens drawn uniformly from [lo, hi]
    bound: int  # max_seq_len the graph is captured with (the engine's max_model_len)

    @property
    def name(self) -> str:
        shape = {(32, 8, 128): "llama3_8b", (9, 3, 64): "smollm2"}.get(self.heads, str(self.heads))
        return f"{shape} b{self.batch} ctx{self.context[0]}-{self.context[1]} bound{self.bound}"


L8B, SMOL = (32, 8, 128), (9, 3, 64)
GPU_POINTS = [
    Point(L8B, 32, (128, 256), 272),  # benchmark_throughput's 128 + 128 tokens
    Point(L8B, 32, (64, 128), 1024),  # benchmark_decode_profile's 64-token prompts
    Point(L8B, 32, (128, 256), 8192),  # a served engine's default bound
    Point(L8B, 32, (1024, 2048), 8192),
    Point(L8B, 1, (128, 256), 272),
    Point(L8B, 1, (128, 256), 8192),
    Point(SMOL, 1, (128, 256), 272),
    Point(SMOL, 1, (64, 128), 1024),
    Point(SMOL, 1, (128, 256), 8192),
    Point(L8B, 1, (1024, 2048), 8192),  # long contexts at batch 1: every split busy
    Point(L8B, 1, (4096, 8000), 8192),
    Point(SMOL, 1, (1024, 2048), 8192),
    Point(SMOL, 32, (128, 256), 272),
    Point(SMOL, 32, (128, 256), 8192),
]
SMOKE_POINTS = [Point((4, 2, 32), 3, (5, 300), 512)]  # 4 splits on the interpreter's 8 SMs
BLOCK_SIZE = 16


def _layer_batches(point: Point, layers: int, dtype, device: str, gen: torch.Generator):
    """One cache + block table per layer; the same lengths for every layer (one step)."""
    heads, kv_heads, head_size = point.heads
    lo, hi = point.context
    seq_lens = torch.randint(lo, hi + 1, (point.batch,), generator=gen, device="cpu")
    blocks = [-(-int(s) // BLOCK_SIZE) for s in seq_lens]
    width = -(-point.bound // BLOCK_SIZE)
    num_blocks = sum(blocks) + 1
    common = dict(
        query_start_loc=torch.arange(point.batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        scale=head_size**-0.5,
        max_query_len=1,
        max_seq_len=point.bound,
    )
    out = []
    for _ in range(layers):
        cache = torch.empty(num_blocks, 2, BLOCK_SIZE, kv_heads, head_size, dtype=dtype,
                            device=device).normal_()
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
        table = torch.zeros(point.batch, width, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks):
            table[i, :n] = perm[used : used + n]
            used += n
        query = torch.empty(point.batch, heads, head_size, dtype=dtype, device=device).normal_()
        out.append(dict(common, query=query, kv_cache=cache, output=torch.empty_like(query),
                        block_table=table.to(device)))
    kv_bytes = int(seq_lens.sum()) * kv_heads * head_size * 2 * torch.finfo(dtype).bits // 8
    return out, kv_bytes


def _variants(point: Point, baseline):
    from vllm.v1.attention.ops import unified_attention as ua
    from vllm.v1.attention.ops.attention_config import (
        DECODE_CONFIG,
        MIN_TOKENS_PER_SPLIT,
        num_sms,
        select_config,
    )

    heads, kv_heads, head_size = point.heads
    auto = select_config(
        num_tokens=point.batch, num_reqs=point.batch, num_kv_heads=kv_heads,
        queries_per_kv=heads // kv_heads, head_size=head_size, max_query_len=1,
        max_seq_len=point.bound, dtype=torch.bfloat16, sm_count=num_sms(torch.device("cuda"))
        if torch.cuda.is_available() else 8,
    )
    variants = {
        "auto": (ua.unified_attention, None),
        "search": (ua.unified_attention, replace(auto, decode=False, split_min_tiles=1,
                                                 num_stages=DECODE_CONFIG.num_stages)),
        "decode_min1": (ua.unified_attention, replace(auto, split_min_tiles=1)),
        "min_tokens": (ua.unified_attention,
                       replace(auto, split_min_tiles=max(1, MIN_TOKENS_PER_SPLIT // auto.block_n))),
        "one_split": (ua.unified_attention, replace(auto, num_splits=1)),
    }
    if baseline is not None:
        variants["baseline"] = (baseline.unified_attention, None)
    return auto, variants


SWEEP_POINTS = [
    Point(L8B, 32, (128, 256), 272),
    Point(L8B, 32, (128, 256), 8192),
    Point(L8B, 32, (1024, 2048), 8192),
    Point(L8B, 1, (128, 256), 8192),
    Point(SMOL, 1, (128, 256), 272),
    Point(SMOL, 1, (128, 256), 8192),
    Point(SMOL, 1, (1024, 2048), 8192),
    Point(SMOL, 32, (128, 256), 8192),
]


def sweep(layers: int, device: str, dtype) -> list[dict]:
    """Key tile x pipeline depth x split policy for the decode points, fastest first."""
    import itertools

    from vllm.v1.attention.ops import unified_attention as ua

    rows = []
    for point, (workspace, batches, kv_bytes, (auto, _)) in _setups(
        SWEEP_POINTS, layers, None, device, dtype
    ):
        row = {"point": point.name, "auto_splits": auto.num_splits, "kv_bytes_per_layer": kv_bytes,
               "results": []}
        for (bn, stages), policy in itertools.product(
            ((64, 3), (64, 5), (32, 5), (32, 3)), ("auto", "one_split", "min512")
        ):
            cfg = replace(auto, block_n=bn, num_stages=stages)
            if policy == "one_split":
                cfg = replace(cfg, num_splits=1)
            elif policy == "min512":
                cfg = replace(cfg, split_min_tiles=512 // bn)
            entry = {"block_n": bn, "stages": stages, "policy": policy}
            try:
                entry["us"] = _time_graph(ua.unified_attention, batches, workspace, cfg, 50,
                                          device)
                entry["err"] = _max_error(ua.unified_attention, batches[0], workspace, cfg)
            except Exception as e:  # a tile that does not compile: record it, go on
                entry["error"] = str(e)[:200]
            row["results"].append(entry)
        row["results"].sort(key=lambda r: r.get("us") or 1e9)
        print(row["point"], [(r["block_n"], r["stages"], r["policy"], round(r.get("us") or -1, 2))
                             for r in row["results"][:6]], file=sys.stderr)
        rows.append(row)
    return rows


def _time_graph(launch, batches, workspace, config, replays: int, device: str) -> float | None:
    """Microseconds per layer of one graph of every layer's launch (None on the CPU)."""

    def layer(b):
        kwargs = dict(b, workspace=workspace)
        if config is not None:
            kwargs["config"] = config
        return lambda: launch(**kwargs)

    fns = [layer(b) for b in batches]
    if device != "cuda":
        for f in fns:
            f()
        return None
    return graph_us(fns, replays)


def _max_error(launch, batch, workspace, config) -> float:
    from vllm.v1.attention.ops.unified_attention import unified_attention_ref

    kwargs = dict(batch, workspace=workspace)
    if config is not None:
        kwargs["config"] = config
    launch(**kwargs)
    ref = unified_attention_ref(batch["query"], batch["kv_cache"], batch["query_start_loc"],
                                batch["seq_lens"], batch["block_table"], batch["scale"])
    return float((batch["output"].float() - ref.float()).abs().max())


def _setups(points, layers: int, baseline, device: str, dtype):
    """Per point: (workspace, per-layer batches, KV bytes a layer, (auto config, variants))."""
    from vllm.v1.attention.ops.attention_config import max_split_workspace_numel

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    for point in points:
        heads, _, head_size = point.heads
        workspace = torch.zeros(max_split_workspace_numel(heads, head_size),
                                dtype=torch.float32, device=device)
        batches, kv_bytes = _layer_batches(point, layers, dtype, device, gen)
        yield point, (workspace, batches, kv_bytes, _variants(point, baseline))


def measure(points, layers: int, baseline, device: str, dtype) -> dict:
    copy = copy_bandwidth(1 << 30, device=device) if device == "cuda" else None
    rows = []
    for point, (workspace, batches, kv_bytes, (auto, variants)) in _setups(
        points, layers, baseline, device, dtype
    ):
        row = {"point": point.name, "auto_config": auto.__dict__.copy(),
               "kv_bytes_per_layer": kv_bytes}
        if copy is not None:
            row["ideal_us"] = kv_bytes / copy["bytes_per_s"] * 1e6
        for name, (launch, config) in variants.items():
            # An older kernel lays its workspace out differently (no arrival counters
            # at the front): it gets a scratch of its own, so it cannot leave the
            # current kernel's counters nonzero.
            ws = torch.zeros_like(workspace) if name == "baseline" else workspace
            us = _time_graph(launch, batches, ws, config, 50, device)
            err = _max_error(launch, batches[0], ws, config)
            row[name] = {"us_per_layer": us, "max_abs_error": err}
        rows.append(row)
        print(json.dumps({k: (v["us_per_layer"] if isinstance(v, dict) and "us_per_layer" in v
                              else v) for k, v in row.items() if k != "auto_config"}),
              file=sys.stderr)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
            "copy_bandwidth": copy, "layers": layers, "dtype": str(dtype), "points": rows}


def _load_baseline(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("baseline_unified_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--layers", type=positive_int, default=32,
                        help="launches per captured graph, each on its own layer's cache "
                             "(default: %(default)s)")
    parser.add_argument("--baseline-module", help="an older unified_attention.py to compare")
    parser.add_argument("--sweep", action="store_true", help="tiles / stages / splits grid")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        problem = smoke_env_problem("benchmark_decode_attention")
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        result = measure(SMOKE_POINTS, 2, None, "cpu", torch.float32)
        result["smoke"] = "tiny shapes on the CPU interpreter: the numbers mean nothing"
    elif not torch.cuda.is_available():
        print(no_gpu_message("benchmark_decode_attention"), file=sys.stderr)
        return 2
    elif args.sweep:
        result = {"sweep": sweep(args.layers, "cuda", torch.bfloat16)}
    else:
        result = measure(GPU_POINTS, args.layers, _load_baseline(args.baseline_module), "cuda",
                         torch.bfloat16)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
