"""Tile sizes and split-KV rules of the unified attention kernel: the one place to tune.

Everything here is a pure function of tensor shapes, dtypes and the host
bounds max_query_len / max_seq_len, never of per-step device values, so a
CUDA graph captured with a config stays valid for every batch of its shape
(see unified_attention.py). `benchmarks/benchmark_attention.py` times a grid
of alternatives ("tune" in its JSON) to choose the constants below.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch
import triton


@dataclass(frozen=True)
class AttentionKernelConfig:
    """Tile config of one launch.

    Attributes:
        block_m: rows per program = query tokens per program x padded GQA group
            (power of two, >= 16 so tl.dot has a tensor-core shape).
        block_n: key tokens per tile (power of two, >= 16); may span several cache blocks.
        num_splits: KV ranges per (q block, KV head); 0 = choose from shapes.
        num_warps, num_stages: Triton launch options.
        decode: one request per program and no request search; only for
            launches whose max_query_len is 1 (the decode CUDA graphs).
        split_min_tiles: a split takes at least this many key tiles, so a range
            shorter than num_splits x that runs on fewer splits (the others
            idle); 0 = the default of `min_tiles_per_split`.
    """

    block_m: int
    block_n: int
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2
    decode: bool = False
    split_min_tiles: int = 0

    def min_tiles_per_split(self) -> int:
        """split_min_tiles, resolved (>= 1).

        The default (0) is one tile for a DECODE launch of more than
        FUSED_REDUCE_MAX_SPLITS splits and MIN_TOKENS_PER_SPLIT keys' worth for
        the rest. Such a launch is followed by `_reduce_splits_kernel`, whose cost
        does not depend on how many splits held keys, so a short range is best
        spread over as many splits as it has tiles. benchmark_decode_attention.py
        on an H100 (2026-12-06, batch 1, 8192 bound, 32 splits, us a layer, one
        tile vs MIN_TOKENS_PER_SPLIT): 128-256 tokens 6.86 vs 8.04 (Llama-3-8B
        heads), 5.20 vs 6.15 (SmolLM2 heads); 1024-2048 tokens 8.94 vs 9.59 and
        6.17 vs 6.97; 4096-8000 tokens (Llama-3-8B) 15.23 vs 15.10, where every
        split already holds several tiles. A launch that reduces in its last split
        pays for every extra active split (SmolLM2 heads, 8 splits, 64-128 tokens:
        4.42 with one tile vs 4.22), so it keeps MIN_TOKENS_PER_SPLIT.
        """
        if self.split_min_tiles:
            return self.split_min_tiles
        if self.decode and self.num_splits > FUSED_REDUCE_MAX_SPLITS:
            return 1
        return max(1, MIN_TOKENS_PER_SPLIT // self.block_n)


# Decode-like batches (max_query_len x padded group <= DECODE_MAX_ROWS): few rows
# per program, memory bound. 16 rows use mma.sync; 64-key tiles (4 blocks of 16)
# put 32 KiB of K+V in flight per program; 122 registers (sm_90, Triton 3.6) let
# 4 programs share an SM. Prefill-like batches use wgmma tiles: the large tile
# (256 rows x 64 keys, 8 warps) where programs have many keys to amortise each
# K/V tile over (max_seq_len >= LARGE_MIN_SEQ_LEN and more than LARGE_MIN_ROWS
# rows), else the small one (64 x 32, 4 warps), which keeps short prompts spread
# over more programs. Measured on the H200 (2026-12-02, GPU time of CUDA-graph
# replays, Llama-3-8B heads, bf16; the sweep is quoted in docs/benchmarks.md):
#   prefill 8 x 2048       large 0.789 ms (349 TFLOP/s)  small 0.860  (128 x 32: 0.838)
#   4 x 512, context 3584  large 0.362 ms                small 0.436
#   8 x 128, context 2048  large 107 us                  small 167
#   16 x 96 / 16 x 512     large 25.7 / 172 us           small 16.3 / 154
#   8 x 32, context 2048   large 102 us                  small 84
# The "tune" grids of benchmarks/benchmark_attention.py time the alternatives.
DECODE_MAX_ROWS = 64
LARGE_MIN_ROWS = 128
LARGE_MIN_SEQ_LEN = 1024
DECODE_CONFIG = AttentionKernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
# One query token per request (max_query_len 1: the decode CUDA graphs): one program
# per request and KV head, no request search, one masked loop over the tiles, and
# num_stages 5, which gives the 16-row tiles two K/V buffers (3 and 4 give one:
# Triton 3.6 sm_90 TTGIR). In the sweep (H200, 2026-12-04, a graph of 32 layers'
# decode attention captured at max_model_len, 128-256-token contexts;
# benchmark_decode_attention.py --sweep), two loops with 5 stages lost to one
# loop, and one loop with 3 stages and one split lost at 1024-2048 tokens (71.4
# against 63.8 us a layer). With the split rule below, against the kernel before
# (1308477), microseconds a layer: Llama-3-8B heads, batch 32: 12.5 vs 17.8 (bound
# 272), 12.8 vs 17.3 (8192), 58.3 vs 73.9 at 1024-2048 tokens; SmolLM2 heads,
# batch 1: 5.7 vs 6.5 (272), 6.2 vs 6.0 (8192, 32 splits). docs/benchmarks.md.
DECODE_ONE_TOKEN_STAGES = 5
ONE_TOKEN_CONFIG = replace(DECODE_CONFIG, num_stages=DECODE_ONE_TOKEN_STAGES, decode=True)
SMALL_PREFILL_CONFIG = AttentionKernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
PREFILL_CONFIG = AttentionKernelConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
# fp32 (ieee dot, no tensor cores): smaller tiles and 8 warps keep it free of spills.
DECODE_CONFIG_FP32 = AttentionKernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=2)
PREFILL_CONFIG_FP32 = AttentionKernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
# Split-KV: add splits (powers of two) until the grid has SPLIT_TARGET_PROGRAMS_PER_SM
# programs per SM (DECODE_SPLIT_TARGET_PROGRAMS_PER_SM for one query token per
# request), while each split keeps >= MIN_TOKENS_PER_SPLIT keys of max_seq_len and
# the workspace stays within MAX_SPLIT_ROWS x num_heads rows. A decode grid that
# already has a program per SM does not split: a graph's split count is fixed by
# max_model_len, and for the short contexts most steps see, splitting costs the
# reduce launch and idle programs (sweep above: Llama-3-8B heads at batch 32, one
# split 13.4-13.8 us a layer against 16.0-18.9 with 2-4 splits; at 1024-2048
# tokens 63.8 against 62.6-63.8). Small batches still split (SmolLM2 heads, batch
# 1, 1024-2048 tokens: one split 21.5 us, 32 splits 6.4), though at 128-256
# tokens one split would be faster (4.9 against 5.7 us): a graph's split count
# is fixed by its bound.
SPLIT_TARGET_PROGRAMS_PER_SM = 4
DECODE_SPLIT_TARGET_PROGRAMS_PER_SM = 1
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLIT_ROWS = 1024  # num_splits x num_tokens; sizes the preallocated workspace
# A decode launch of up to this many splits combines them in its last split to
# finish (no reduce launch). benchmark_decode_attention.py on an H100 (2026-12-06,
# us a layer, fused vs `_reduce_splits_kernel`): 2 splits 5.12 vs 5.70 (SmolLM2
# heads, batch 1), 6.99 vs 7.65 (Llama-3-8B heads, batch 1), 7.89 vs 8.54 (SmolLM2,
# batch 32); 8 splits 5.50 vs 5.87; but 32 splits 6.61 vs 6.21 and 8.72 vs 8.11:
# one program combining 32 partials serially costs more than the launch it saves.
# Rechecked after idle splits learned to leave at once (second run of 2026-12-06):
# fusing every launch of up to 32 splits still lost at 32 (6.84 vs 6.17 SmolLM2,
# 8.81 vs 8.13 Llama-3-8B, batch 1, 128-256 tokens under an 8192 bound).
FUSED_REDUCE_MAX_SPLITS = 8
# Requests scanned per step of the in-kernel search for a program's request.
REQUEST_SCAN_BLOCK = 128


@dataclass(frozen=True)
class FreshPrefillConfig:
    """Tile config of `prefill_attention` (prompts without cached context).

    Attributes:
        block_m: rows per program = query tokens x query heads of one KV head
            (power of two >= 16; the tokens, block_m / heads, must be >= 16).
        block_n: keys per K/V tile (one TMA copy each).
        max_group: most query heads of one KV head a program serves (the GQA
            group, or the largest power of two dividing it, whichever is smaller).
        num_warps, num_stages: Triton launch options.
    """

    block_m: int
    block_n: int
    max_group: int = 1
    num_warps: int = 8
    num_stages: int = 3


# Fastest of `benchmark_attention.py --tune fresh` for 8 x 2048 Llama-3-8B heads on an
# H100 (2026-12-05: 0.642 ms against 0.735 for 128 x 64 / 8 warps; 256-row tiles and
# Triton warp specialization slower or not compiling in an earlier sweep).
FRESH_PREFILL_CONFIG = FreshPrefillConfig(block_m=64, block_n=64, max_group=1, num_warps=4,
                                          num_stages=3)
FRESH_PREFILL_MIN_QUERY_LEN = 128
FRESH_PREFILL_HEAD_SIZES = (64, 128)


def head_pad(head_size: int) -> int:
    """Padded head size the kernel computes with (power of two, >= 16)."""
    return max(triton.next_power_of_2(head_size), 16)


def split_counters_numel(num_heads: int) -> int:
    """Elements at the front of a split-KV workspace that hold the decode kernel's
    per-program arrival counters (int32 in fp32 slots; zero when allocated, and the
    kernel leaves them zero). A decode launch needs one per program of its grid's
    first dimension, max(num_tokens, num_reqs) x num_kv_heads; one with more programs
    than this launches the reduce kernel instead."""
    return MAX_SPLIT_ROWS * num_heads


def split_workspace_numel(num_splits: int, num_tokens: int, num_heads: int, head_size: int) -> int:
    """fp32 elements the split-KV workspace needs: the counters, then accumulators plus
    (max, sum) per row."""
    return split_counters_numel(num_heads) + num_splits * num_tokens * num_heads * (
        head_pad(head_size) + 2)


def max_split_workspace_numel(num_heads: int, head_size: int) -> int:
    """Workspace (fp32 elements) that covers every automatically chosen split count."""
    return split_workspace_numel(1, MAX_SPLIT_ROWS, num_heads, head_size)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (static: asked once per device)."""
    if device.type != "cuda":
        return 8  # the interpreter: any small constant
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device (static: asked once per device)."""
    return torch.cuda.get_device_capability(device)


def select_config(
    *,
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_size: int,
    max_query_len: int,
    max_seq_len: int,
    dtype: torch.dtype,
    sm_count: int,
) -> AttentionKernelConfig:
    """Tile config and split count for a launch, from shapes and host bounds only.

    Splits double while the grid is smaller than SPLIT_TARGET_PROGRAMS_PER_SM x
    sm_count programs, each split keeps MIN_TOKENS_PER_SPLIT of max_seq_len and
    splits x num_tokens stays within MAX_SPLIT_ROWS (the preallocated workspace).
    """
    group_pad = triton.next_power_of_2(queries_per_kv)
    rows = max(max_query_len, 1) * group_pad
    fp32 = dtype == torch.float32
    decode = max_query_len <= 1
    if rows <= DECODE_MAX_ROWS:
        base = DECODE_CONFIG_FP32 if fp32 else ONE_TOKEN_CONFIG if decode else DECODE_CONFIG
        block_m = max(base.block_m, triton.next_power_of_2(rows))
    else:
        if fp32:
            base = PREFILL_CONFIG_FP32
        elif rows > LARGE_MIN_ROWS and max_seq_len >= LARGE_MIN_SEQ_LEN:
            base = PREFILL_CONFIG
        else:
            base = SMALL_PREFILL_CONFIG
        block_m = max(base.block_m, group_pad)
    if head_pad(head_size) > 128:  # large heads: halve the tiles to stay in shared memory
        base = replace(base, block_n=max(16, base.block_n // 2))
        if rows > DECODE_MAX_ROWS:
            block_m = max(16, group_pad, block_m // 2)
    block_q = 1 if decode else block_m // group_pad
    # Parallelism estimate: q blocks that really carry work (decode: one per request).
    q_blocks = min(
        num_tokens // block_q + num_reqs, num_reqs * triton.cdiv(max(max_query_len, 1), block_q)
    )
    programs = max(q_blocks, 1) * num_kv_heads
    target = DECODE_SPLIT_TARGET_PROGRAMS_PER_SM if decode else SPLIT_TARGET_PROGRAMS_PER_SM
    splits = 1
    while (
        splits * 2 <= MAX_SPLITS
        and programs * splits < sm_count * target
        and splits * 2 * num_tokens <= MAX_SPLIT_ROWS
        and max_seq_len >= splits * 2 * MIN_TOKENS_PER_SPLIT
    ):
        splits *= 2
    return replace(base, block_m=block_m, num_splits=splits, decode=decode)


def check_config(cfg: AttentionKernelConfig, group_pad: int) -> None:
    """Raises ValueError for tiles the kernel cannot use (tl.dot needs >= 16, powers of two)."""

    def pow2(x: int) -> bool:
        return x > 0 and not x & (x - 1)

    if not (pow2(cfg.block_m) and cfg.block_m >= max(16, group_pad)):
        raise ValueError(
            f"block_m must be a power of two >= max(16, GQA group {group_pad}), got {cfg.block_m}"
        )
    if not (pow2(cfg.block_n) and cfg.block_n >= 16):
        raise ValueError(f"block_n must be a power of two >= 16, got {cfg.block_n}")
    if cfg.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {cfg.num_splits}")
    if cfg.split_min_tiles < 0:
        raise ValueError(f"split_min_tiles must be >= 0, got {cfg.split_min_tiles}")


def reachable_configs(
    *,
    num_kv_heads: int,
    queries_per_kv: int,
    head_size: int,
    dtype: torch.dtype,
    sm_count: int,
    max_num_tokens: int,
    max_model_len: int,
) -> list[tuple[int, AttentionKernelConfig]]:
    """Every config `select_config` can return for batches within the engine's bounds.

    Each comes with the smallest max_query_len that selects its tiles (a launch
    of that many query tokens for one request can use it). Start-up warm-up
    compiles each one, so no request meets a tile or split count the kernel
    has not been compiled for (issue 10: 0.5-1.2 s of TTFT per new class).

    Why enumerating this is exact: the tiles depend only on max_query_len x the
    padded GQA group (each power of two up to DECODE_MAX_ROWS, then the small
    prefill tile up to LARGE_MIN_ROWS, then the small or the large one by
    whether max_seq_len reaches LARGE_MIN_SEQ_LEN), so every max_query_len up
    to the first large-tile one is tried, at max_seq_len = max_model_len and
    just below LARGE_MIN_SEQ_LEN. The split count only falls as the grid
    (requests, tokens) grows and only rises with max_seq_len, whose
    MIN_TOKENS_PER_SPLIT rule can stop the doubling at any power of two; so for
    each tile the reachable splits are the powers of two up to the count chosen
    for one request of that query length at the largest max_seq_len that
    selects the tile.

    Args:
        max_num_tokens: the most tokens one step can schedule.
        max_model_len: the longest sequence (keys) a request can reach.
    """
    group_pad = triton.next_power_of_2(queries_per_kv)
    top = min(LARGE_MIN_ROWS // group_pad + 1, max_num_tokens, max_model_len)
    seq_bounds = sorted({max_model_len, min(max_model_len, LARGE_MIN_SEQ_LEN - 1)})
    found: dict[AttentionKernelConfig, int] = {}
    for query_len, max_seq_len in itertools.product(range(1, top + 1), seq_bounds):
        if query_len > max_seq_len:
            continue
        cfg = select_config(
            num_tokens=query_len, num_reqs=1, num_kv_heads=num_kv_heads,
            queries_per_kv=queries_per_kv, head_size=head_size, max_query_len=query_len,
            max_seq_len=max_seq_len, dtype=dtype, sm_count=sm_count,
        )
        splits = 1
        while splits <= cfg.num_splits:
            found.setdefault(replace(cfg, num_splits=splits), query_len)
            splits *= 2
    return sorted(((q, cfg) for cfg, q in found.items()),
                  key=lambda item: (item[0], item[1].num_splits))
