"""How close the Triton paged attention comes to the H200's limits, measured in one run.

Question: does decode attention stream the KV cache at >= 0.7 of the device's
copy bandwidth (bf16, batch 64 x context 4096, Llama-3-8B heads)? And how does
causal prefill compare with a bf16 matmul?

    python benchmarks/benchmark_attention.py [--out FILE] [--tune [decode prefill fresh]]
                                             [--dtype bfloat16]
    TRITON_INTERPRET=1 python benchmarks/benchmark_attention.py --smoke   # CPU: code path only

Prints one JSON document (and writes it to --out):
  copy_bandwidth      dst.copy_(src) of a 2 GiB buffer; bytes = 2 x size (read + write)
  matmul              bf16 8192^3 torch.matmul; FLOPs = 2 x 8192^3
  decode              64 x 4096 with the launcher's own choice of tiles and splits:
                      bytes = K and V of every cached token read once
                      (batch x context x kv_heads x head_size x 2 x itemsize),
                      ratio = (bytes / time) / copy bandwidth; target >= 0.7
  decode_sweep        the same for batch {1,8,32,64,128} x context {512,1024,4096,8192}
  prefill             8 x 2048-token causal prefills, no cached context;
                      FLOPs = 4 x head_size x num_heads x sum_i q_i (q_i + 1) / 2
                      (QK^T and PV over the causal (query, key) pairs), ratio to matmul
                      through the paged kernel (unified_attention, keys read from the cache)
  prefill_fresh       the same prompts through prefill_attention, the kernel the engine
                      runs for a step of fresh prompts (this step's key/value rows read
                      by TMA; sm_90+): same FLOPs, ratio to matmul; target >= 0.55
                      (issue 10); max_abs_error against the paged kernel's output
  prefill_peer        the same prompts through torch's scaled_dot_product_attention,
                      causal, K/V expanded to every query head, each backend that takes
                      it (flash, cuDNN): time and ratio to matmul (CUDA only)
  reshape_and_cache   16384 tokens written; bytes = 2 x (K + V bytes) (read + write)
  tune                every config of a small grid for decode 64x4096, prefill 8x2048
                      and prefill_fresh 8x2048 (those --tune names; default all),
                      fastest first: pick the winners for
                      the constants in vllm/v1/attention/ops/attention_config.py
Times: triton.testing.do_bench (L2 flushed before each call), median in ms.
Block tables are random permutations of the cache blocks (no locality help).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass

import torch
from common import (  # puts the checkout on sys.path
    add_smoke_flag,
    copy_bandwidth,
    no_gpu_message,
    smoke_env_problem,
)

TARGET_DECODE_RATIO = 0.7
TARGET_PREFILL_RATIO = 0.55
GiB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """What to measure; SMOKE runs the same code on tiny shapes under the interpreter."""

    device: str
    heads: tuple[int, int, int]  # num_heads, num_kv_heads, head_size
    block_size: int
    copy_bytes: int
    matmul_n: int
    decode: tuple[int, int]  # (batch, context) of the headline
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_q_lens: tuple[int, ...]
    reshape_tokens: int
    max_tune_configs: int


# Llama-3-8B heads, vLLM's default block size.
GPU = Plan(
    "cuda",
    (32, 8, 128),
    16,
    2 * GiB,
    8192,
    (64, 4096),
    (1, 8, 32, 64, 128),
    (512, 1024, 4096, 8192),
    (2048,) * 8,
    16384,
    1000,
)
SMOKE = Plan("cpu", (4, 2, 64), 16, 1 << 20, 128, (2, 64), (1, 2), (48, 64), (40, 24), 64, 2)
PLAN = GPU


def _bench(fn) -> float:
    """Median milliseconds of fn() (do_bench warms up and flushes L2 between calls)."""
    if PLAN.device == "cpu":  # smoke run: one timed call after one warm-up
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def matmul_flops() -> dict:
    n = PLAN.matmul_n
    a = torch.randn(n, n, dtype=torch.bfloat16, device=PLAN.device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=PLAN.device)
    c = torch.empty_like(a)
    ms = _bench(lambda: torch.matmul(a, b, out=c))
    return {"shape": [n, n, n], "time_ms": ms, "flops_per_s": 2 * n**3 / (ms * 1e-3)}


class Cache:
    """One KV cache big enough for the largest case; block tables are random permutations."""

    def __init__(self, max_tokens: int, dtype: torch.dtype):
        _, kv_heads, head_size = PLAN.heads
        self.num_blocks = max_tokens // PLAN.block_size + 1
        shape = (self.num_blocks, 2, PLAN.block_size, kv_heads, head_size)
        self.kv = torch.randn(shape, dtype=dtype, device=PLAN.device)
        self.dtype = dtype
        gen = torch.Generator(device=PLAN.device).manual_seed(0)
        perm = torch.randperm(self.num_blocks - 1, generator=gen, device=PLAN.device)
        self.perm = perm.int() + 1

    def batch(self, q_lens: list[int], seq_lens: list[int]) -> dict:
        """unified_attention's keyword arguments for one batch."""
        heads, _, head_size = PLAN.heads
        blocks = [-(-s // PLAN.block_size) for s in seq_lens]
        if sum(blocks) >= self.num_blocks:
            raise ValueError(f"cache of {self.num_blocks} blocks too small for {sum(blocks)}")
        table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=PLAN.device)
        used = 0
        for i, n in enumerate(blocks):
            table[i, :n] = self.perm[used : used + n]
            used += n
        starts = [0, *itertools.accumulate(q_lens)]
        query = torch.randn(starts[-1], heads, head_size, dtype=self.dtype, device=PLAN.device)
        return dict(
            query=query,
            kv_cache=self.kv,
            output=torch.empty_like(query),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=PLAN.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=PLAN.device),
            block_table=table,
            scale=head_size**-0.5,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )


def _run(batch: dict, config=None, workspace=None) -> float:
    from vllm.v1.attention.ops.unified_attention import unified_attention

    return _bench(lambda: unified_attention(**batch, workspace=workspace, config=config))


def _chosen(batch: dict) -> dict:
    """The config the launcher picks on its own for this batch."""
    from vllm.v1.attention.ops.attention_config import num_sms, select_config

    heads, kv_heads, head_size = PLAN.heads
    q = batch["query"]
    cfg = select_config(
        num_tokens=q.shape[0],
        num_reqs=batch["seq_lens"].shape[0],
        num_kv_heads=kv_heads,
        queries_per_kv=heads // kv_heads,
        head_size=head_size,
        max_query_len=batch["max_query_len"],
        max_seq_len=batch["max_seq_len"],
        dtype=q.dtype,
        sm_count=num_sms(q.device),
    )
    return cfg.__dict__.copy()


def kv_bytes(batch_size: int, context: int, itemsize: int) -> int:
    """K and V bytes of every cached token, read once."""
    _, kv_heads, head_size = PLAN.heads
    return batch_size * context * kv_heads * head_size * 2 * itemsize


def decode_point(cache: Cache, batch_size: int, context: int, copy_bps: float, workspace) -> dict:
    b = cache.batch([1] * batch_size, [context] * batch_size)
    nbytes = kv_bytes(batch_size, context, cache.kv.element_size())
    ms = _run(b, workspace=workspace)
    bps = nbytes / (ms * 1e-3)
    return {
        "batch": batch_size,
        "context": context,
        "time_ms": ms,
        "kv_bytes": nbytes,
        "bytes_per_s": bps,
        "ratio_to_copy": bps / copy_bps,
        "config": _chosen(b),
    }


def max_error(batch: dict, num_reqs: int = 2) -> float:
    """Max |kernel - reference| over the first requests of a batch (sanity check)."""
    from vllm.v1.attention.ops.unified_attention import unified_attention, unified_attention_ref

    unified_attention(**batch)
    end = int(batch["query_start_loc"][num_reqs])
    ref = unified_attention_ref(
        batch["query"][:end],
        batch["kv_cache"],
        batch["query_start_loc"][: num_reqs + 1],
        batch["seq_lens"][:num_reqs],
        batch["block_table"][:num_reqs],
        batch["scale"],
    )
    return float((batch["output"][:end].float() - ref.float()).abs().max())


def prefill_flops(q_lens) -> int:
    """QK^T and PV over the causal (query, key) pairs of prompts with no cached context."""
    heads, _, head_size = PLAN.heads
    return 4 * head_size * heads * sum(q * (q + 1) // 2 for q in q_lens)


def tune(batch: dict, configs, amount: float, key: str, base: float) -> list[dict]:
    """Time every config; amount / seconds is bytes/s or FLOP/s; ratio to `base`; fastest first."""
    rows = []
    for cfg in itertools.islice(configs, PLAN.max_tune_configs):
        row = {"config": cfg.__dict__.copy()}
        try:
            ms = _run(batch, config=cfg)
            row.update(time_ms=ms, **{key: amount / (ms * 1e-3)}, ratio=amount / (ms * 1e-3) / base)
        except Exception as e:  # e.g. out of shared memory for a large tile: record, go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return sorted(rows, key=lambda r: r.get("time_ms", float("inf")))


def decode_configs():
    from vllm.v1.attention.ops.attention_config import AttentionKernelConfig

    for block_n, (warps, stages), splits in itertools.product(
        (32, 64, 128), ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3)), (1, 2, 4, 8, 16)
    ):
        yield AttentionKernelConfig(16, block_n, splits, warps, stages)


def prefill_configs():
    from vllm.v1.attention.ops.attention_config import AttentionKernelConfig

    for block_m, block_n, (warps, stages) in itertools.product(
        (64, 128, 256), (32, 64, 128), ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4))
    ):
        yield AttentionKernelConfig(block_m, block_n, 1, warps, stages)


def fresh_rows(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's key/value rows of a no-context prefill batch, laid out as the model
    passes them (strided slices of one qkv row), also written into the batch's cache
    slots so the paged kernel attends to the same keys."""
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache

    query, table = batch["query"], batch["block_table"]
    _, kv_heads, head_size = PLAN.heads
    width = kv_heads * head_size
    qkv = torch.randn(query.shape[0], query[0].numel() + 2 * width, dtype=query.dtype,
                      device=PLAN.device)
    key = qkv[:, -2 * width : -width].view(-1, kv_heads, head_size)
    value = qkv[:, -width:].view(-1, kv_heads, head_size)
    slots = []
    for i, n in enumerate(batch["seq_lens"].tolist()):
        pos = torch.arange(n, device=PLAN.device)
        slots.append(table[i, pos // PLAN.block_size].long() * PLAN.block_size
                     + pos % PLAN.block_size)
    reshape_and_cache(key, value, batch["kv_cache"], torch.cat(slots))
    return key, value


def fresh_prefill_point(batch: dict, rows: tuple, paged: torch.Tensor, flops: int,
                        matmul_fps: float, config=None) -> dict:
    """prefill_attention on `rows` (from fresh_rows): time, FLOP/s, ratio, error vs `paged`,
    the paged kernel's output on the same keys."""
    from vllm.v1.attention.ops.prefill_attention import prefill_attention

    out = torch.empty_like(batch["query"])
    args = (batch["query"], *rows, out, batch["query_start_loc"], batch["scale"])
    ms = _bench(lambda: prefill_attention(*args, config=config))
    return {
        "time_ms": ms,
        "flops_per_s": flops / (ms * 1e-3),
        "ratio_to_matmul": flops / (ms * 1e-3) / matmul_fps,
        "max_abs_error_vs_paged": float((out.float() - paged.float()).abs().max()),
    }


def sdpa_peer(batch: dict, rows: tuple, flops: int, matmul_fps: float) -> dict:
    """torch SDPA (causal) on the same equal-length prompts, per backend: the peer the
    fresh kernel is compared with. K/V are expanded to every query head before timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q_lens = batch["seq_lens"].tolist()
    if PLAN.device != "cuda" or len(set(q_lens)) != 1:
        return {"skipped": "CUDA and equal prompt lengths only"}
    heads, kv_heads, head_size = PLAN.heads
    num_reqs, q_len = len(q_lens), q_lens[0]

    def bhsd(x: torch.Tensor) -> torch.Tensor:  # [tokens, h, d] -> [reqs, heads, q_len, d]
        x = x.reshape(num_reqs, q_len, x.shape[1], head_size).transpose(1, 2)
        return x.repeat_interleave(heads // x.shape[1], dim=1).contiguous()

    q, k, v = bhsd(batch["query"]), bhsd(rows[0]), bhsd(rows[1])
    result = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = _bench(lambda: sdpa(q, k, v, is_causal=True, scale=batch["scale"]))
            result[name] = {"time_ms": ms, "ratio_to_matmul": flops / (ms * 1e-3) / matmul_fps}
        except RuntimeError as e:  # backend not built in or not taking this shape
            result[name] = {"error": f"{e}"[:200]}
    return result


def fresh_configs():
    from vllm.v1.attention.ops.attention_config import FreshPrefillConfig

    for (block_m, group), block_n, warps, stages in itertools.product(
        ((64, 1), (64, 2), (128, 1), (128, 2), (128, 4)), (64, 128), (4, 8), (3, 4)
    ):
        yield FreshPrefillConfig(block_m, block_n, group, warps, stages)


def tune_fresh(batch: dict, kv_rows: tuple, paged: torch.Tensor, flops: int,
               matmul_fps: float) -> list[dict]:
    rows = []
    for cfg in itertools.islice(fresh_configs(), PLAN.max_tune_configs):
        row = {"config": cfg.__dict__.copy()}
        try:
            row.update(fresh_prefill_point(batch, kv_rows, paged, flops, matmul_fps, cfg))
        except Exception as e:  # e.g. out of shared memory for a large tile: record, go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return sorted(rows, key=lambda r: r.get("time_ms", float("inf")))


def reshape_and_cache_point(dtype: torch.dtype, copy_bps: float) -> dict:
    """Bytes = K and V rows read once and written once."""
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache

    _, kv_heads, head_size = PLAN.heads
    tokens, bs = PLAN.reshape_tokens, PLAN.block_size
    key = torch.randn(tokens, kv_heads, head_size, dtype=dtype, device=PLAN.device)
    value = torch.randn_like(key)
    cache_shape = (tokens // bs + 1, 2, bs, kv_heads, head_size)
    cache = torch.zeros(cache_shape, dtype=dtype, device=PLAN.device)
    slots = torch.randperm(tokens, device=PLAN.device) + bs  # block 0 stays the null block
    nbytes = 2 * 2 * key.numel() * key.element_size()
    ms = _bench(lambda: reshape_and_cache(key, value, cache, slots))
    bps = nbytes / (ms * 1e-3)
    return {
        "tokens": tokens,
        "time_ms": ms,
        "bytes": nbytes,
        "bytes_per_s": bps,
        "ratio_to_copy": bps / copy_bps,
    }


TUNE_GRIDS = ("decode", "prefill", "fresh")
CONVENTIONS = {
    "copy_bandwidth": "dst.copy_(src) of copy_bandwidth.bytes / 2; bytes = 2 x size (read+write)",
    "decode_bytes": "batch x context x num_kv_heads x head_size x 2 (K, V) x itemsize",
    "prefill_flops": "4 x head_size x num_heads x sum q(q+1)/2 (causal pairs; QK^T and PV)",
    "matmul": "bf16 n^3 torch.matmul, 2 x n^3 FLOPs",
    "timing": "triton.testing.do_bench median, L2 flushed before each call",
}


def measure(dtype: torch.dtype, grids: tuple[str, ...]) -> dict:
    """Every measurement of the module docstring, as one JSON-ready dict."""
    import triton

    from vllm.v1.attention.ops.attention_config import max_split_workspace_numel

    heads, kv_heads, head_size = PLAN.heads
    result = {
        "device": torch.cuda.get_device_name() if PLAN.device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_size": head_size,
            "block_size": PLAN.block_size,
        },
        "conventions": CONVENTIONS,
    }
    copy = result["copy_bandwidth"] = copy_bandwidth(PLAN.copy_bytes, _bench, PLAN.device)
    result["matmul"] = matmul_flops()
    copy_bps, matmul_fps = copy["bytes_per_s"], result["matmul"]["flops_per_s"]
    longest = max(PLAN.batches) * max(PLAN.contexts)
    cache = Cache(max(longest, sum(PLAN.prefill_q_lens)), dtype)
    ws = torch.zeros(  # zero: the decode kernel's counters (split_counters_numel)
        max_split_workspace_numel(heads, head_size), dtype=torch.float32, device=PLAN.device
    )

    batch_size, context = PLAN.decode
    headline = decode_point(cache, batch_size, context, copy_bps, ws)
    headline["target_ratio"] = TARGET_DECODE_RATIO
    headline["meets_target"] = headline["ratio_to_copy"] >= TARGET_DECODE_RATIO
    decode_batch = cache.batch([1] * batch_size, [context] * batch_size)
    headline["max_abs_error_first_2_reqs"] = max_error(decode_batch)
    result["decode"] = headline
    result["decode_sweep"] = [
        decode_point(cache, b, c, copy_bps, ws)
        for b, c in itertools.product(PLAN.batches, PLAN.contexts)
    ]
    q_lens = list(PLAN.prefill_q_lens)
    prefill = cache.batch(q_lens, q_lens)
    flops = prefill_flops(q_lens)
    ms = _run(prefill)
    result["prefill"] = {
        "q_lens": q_lens,
        "time_ms": ms,
        "flops": flops,
        "flops_per_s": flops / (ms * 1e-3),
        "ratio_to_matmul": flops / (ms * 1e-3) / matmul_fps,
        "config": _chosen(prefill),
        "max_abs_error_first_2_reqs": max_error(prefill),
    }
    from vllm.v1.attention.ops.prefill_attention import fresh_prefill_supported
    from vllm.v1.attention.ops.unified_attention import unified_attention

    kv_rows = fresh_rows(prefill)
    paged = unified_attention(**prefill).clone()  # the same keys, read from the cache
    fresh_ok = fresh_prefill_supported(prefill["query"], *kv_rows)
    if not fresh_ok:
        why = "prefill_attention does not take this device, dtype or head size"
        result["prefill_fresh"] = {"skipped": why}
    else:
        fresh = result["prefill_fresh"] = fresh_prefill_point(
            prefill, kv_rows, paged, flops, matmul_fps
        )
        fresh["target_ratio"] = TARGET_PREFILL_RATIO
        fresh["meets_target"] = fresh["ratio_to_matmul"] >= TARGET_PREFILL_RATIO
    result["prefill_peer"] = sdpa_peer(prefill, kv_rows, flops, matmul_fps)
    result["reshape_and_cache"] = reshape_and_cache_point(dtype, copy_bps)
    tuned = result["tune"] = {}
    if "decode" in grids:
        tuned[f"decode_{batch_size}x{context}"] = tune(
            decode_batch, decode_configs(), headline["kv_bytes"], "bytes_per_s", copy_bps
        )
    if "prefill" in grids:
        tuned[f"prefill_{len(q_lens)}x{q_lens[0]}"] = tune(
            prefill, prefill_configs(), flops, "flops_per_s", matmul_fps
        )
    if "fresh" in grids and fresh_ok:
        tuned[f"prefill_fresh_{len(q_lens)}x{q_lens[0]}"] = tune_fresh(
            prefill, kv_rows, paged, flops, matmul_fps
        )
    return result


def main(argv: list[str] | None = None) -> int:
    global PLAN
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--tune", nargs="*", choices=TUNE_GRIDS, default=list(TUNE_GRIDS),
                        help="config grids to time (default: all; none: --tune with no name)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="dtype of the queries and the KV cache (default: %(default)s)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        problem = smoke_env_problem("benchmark_attention")
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        PLAN = SMOKE
    elif not torch.cuda.is_available():
        print(no_gpu_message("benchmark_attention"), file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if PLAN.device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float16  # the interpreter's bf16 tl.dot is wrong (Triton 3.9)
    result = measure(dtype, tuple(args.tune))
    if args.smoke:
        result["smoke"] = "tiny shapes on the CPU interpreter: the numbers mean nothing"
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
