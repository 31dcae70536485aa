"""Host side of `unified_attention`'s launch: input checks, tile config, grid, workspace.

Everything here runs on the host before the kernel is launched and reads only
tensor metadata (shapes, strides, dtypes, devices) and the host bounds
max_query_len / max_seq_len: no host sync, so a launch stays CUDA-graph
capturable. The kernels, the launcher and the plain-torch reference stay in
`unified_attention.py`; the tile rules are `attention_config.py`'s.

    unified_attention(...)
      check_inputs          dtypes, shapes, strides, one device   (ValueError)
      choose_config         select_config / an override, checked  (ValueError)
      split_workspace       counters | acc | (max, sum) views      (ValueError)
      launch_grid, kernel_constexprs, fuses_reduce -> _unified_attention_kernel[grid]
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton

from vllm.v1.attention.ops.attention_config import (
    FUSED_REDUCE_MAX_SPLITS,
    REQUEST_SCAN_BLOCK,
    AttentionKernelConfig,
    check_config,
    head_pad,
    num_sms,
    select_config,
    split_counters_numel,
    split_workspace_numel,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate `unified_attention`'s tensors; returns (num_tokens, num_heads, head_size).

    Raises:
        ValueError: the first tensor that does not fit, naming it and its numbers.
    """
    _check_query_and_cache(query, kv_cache, output)
    _check_request_tensors(query_start_loc, seq_lens, block_table)
    _check_one_device(query, kv_cache, output, query_start_loc, seq_lens, block_table)
    num_tokens, num_heads, head_size = query.shape
    return num_tokens, num_heads, head_size


def _check_query_and_cache(
    query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor
) -> None:
    """Shapes, dtypes and last-dim strides of the query, the paged cache and the output."""
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}"
        )
    _, num_heads, head_size = query.shape
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != head_size:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, {head_size}], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of kv_cache heads ({num_kv_heads})"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"kv_cache block_size must be a power of two, got {block_size}")
    if output.shape != query.shape:
        raise ValueError(f"output shape {tuple(output.shape)} != query shape {tuple(query.shape)}")
    if query.dtype not in SUPPORTED_DTYPES or {kv_cache.dtype, output.dtype} != {query.dtype}:
        raise ValueError(
            f"query, kv_cache and output must share one of {SUPPORTED_DTYPES}, got query "
            f"{query.dtype}, kv_cache {kv_cache.dtype}, output {output.dtype}"
        )
    for name, t in (("query", query), ("output", output), ("kv_cache", kv_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_request_tensors(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
) -> None:
    """int32 per-request tensors: seq_lens [R], query_start_loc [R + 1], block_table [>= R, *]."""
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_reqs,)),
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
    ):
        if (
            t.dtype != torch.int32
            or tuple(t.shape) != shape
            or (t.numel() > 1 and t.stride(0) != 1)
        ):
            raise ValueError(
                f"{name} must be contiguous int32 of shape {shape} (num_reqs = seq_lens.shape[0]), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if (
        block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] < num_reqs
        or (block_table.numel() and block_table.stride(1) != 1)
    ):
        raise ValueError(
            f"block_table must be int32 [>= {num_reqs}, max_blocks_per_req] with a contiguous "
            f"last dim, got {block_table.dtype} {tuple(block_table.shape)}"
        )


def _check_one_device(query: torch.Tensor, *others: torch.Tensor) -> None:
    """All tensors on one device, a CUDA one unless Triton interprets on the CPU."""
    devices = {t.device for t in (query, *others)}
    if len(devices) != 1:
        raise ValueError(f"attention tensors must be on one device, got {devices}")
    if query.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"the Triton attention kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"triton is imported), got device {query.device}"
        )


def check_workspace(workspace: torch.Tensor, need: int, device: torch.device) -> None:
    """Raise ValueError unless `workspace` is contiguous fp32 on `device` with >= `need`
    elements."""
    if (
        workspace.dtype != torch.float32
        or workspace.device != device
        or not workspace.is_contiguous()
    ):
        raise ValueError(
            f"split-KV workspace must be contiguous float32 on {device}, got "
            f"{workspace.dtype} on {workspace.device}"
        )
    if workspace.numel() < need:
        raise ValueError(
            f"split-KV workspace has {workspace.numel()} fp32 elements, this launch needs {need}"
        )


def choose_config(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    config: AttentionKernelConfig | None,
) -> AttentionKernelConfig:
    """The launch's tiles and split count: `select_config`'s, or `config` (its
    num_splits 0 taking the automatic count), checked.

    Raises:
        ValueError: tiles the kernel cannot use, or a decode config for a launch
            whose max_query_len is above 1.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    auto = select_config(
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_kv_heads=num_kv_heads,
        queries_per_kv=queries_per_kv,
        head_size=head_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        dtype=query.dtype,
        sm_count=num_sms(query.device),
    )
    cfg = auto if config is None else config
    if cfg.num_splits == 0:
        cfg = replace(cfg, num_splits=auto.num_splits)
    check_config(cfg, triton.next_power_of_2(queries_per_kv))
    if cfg.decode and max_query_len > 1:
        raise ValueError(
            f"a decode config serves one query token per request; max_query_len is {max_query_len}"
        )
    return cfg


def launch_grid(
    cfg: AttentionKernelConfig, num_tokens: int, num_reqs: int, num_heads: int, num_kv_heads: int
) -> tuple[int, int]:
    """(q blocks x KV heads, splits): see the module docstring of `unified_attention.py`.

    A decode launch runs one program per request, and per flat token when it is
    padding; others cover every q block of any batch of this shape.
    """
    if cfg.decode:  # program p: request p, and flat token p if it is padding
        programs = max(num_tokens, num_reqs)
    else:
        group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
        programs = num_tokens // (cfg.block_m // group_pad) + num_reqs
    return programs * num_kv_heads, cfg.num_splits


def split_workspace(
    workspace: torch.Tensor | None, num_splits: int, output: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counters, ws_acc, ws_ml): the split-KV workspace cut into its three parts.

        workspace = [ counters | acc [S, T, H, HEAD_PAD] | (max, sum) [S, T, H, 2] | unused ]
                      int32 in fp32 slots, split_counters_numel(H) of them

    With one split the kernel touches none of them: `output` stands in for all
    three. A None workspace is allocated zero-filled (the counters must start at 0).

    Raises:
        ValueError: a workspace that is not contiguous fp32 on output's device, or
            too small for this launch.
    """
    if num_splits == 1:
        return output, output, output
    num_tokens, num_heads = output.shape[0], output.shape[1]
    need = split_workspace_numel(num_splits, num_tokens, num_heads, head_size)
    if workspace is None:
        workspace = torch.zeros(need, dtype=torch.float32, device=output.device)
    check_workspace(workspace, need, output.device)
    n_cnt = split_counters_numel(num_heads)
    n_acc = num_splits * num_tokens * num_heads * head_pad(head_size)
    counters = workspace[:n_cnt].view(torch.int32)
    return counters, workspace[n_cnt : n_cnt + n_acc], workspace[n_cnt + n_acc : need]


def fuses_reduce(cfg: AttentionKernelConfig) -> bool:
    """Whether a launch with `cfg` combines its splits in its last split to finish:
    decode configs of 2..FUSED_REDUCE_MAX_SPLITS splits."""
    return cfg.decode and 1 < cfg.num_splits <= FUSED_REDUCE_MAX_SPLITS


def kernel_constexprs(
    cfg: AttentionKernelConfig, queries_per_kv: int, head_size: int, block_size: int,
    dtype: torch.dtype, fuse_reduce: bool | None = None,
) -> dict:
    """The `_unified_attention_kernel` constexprs a launch with `cfg` passes (also what
    benchmarks/kernel_resources.py compiles without a GPU). `fuse_reduce` None:
    `fuses_reduce(cfg)` (what `unified_attention` does unless the grid outgrows the
    workspace's counters)."""
    if fuse_reduce is None:
        fuse_reduce = fuses_reduce(cfg)
    group_pad = triton.next_power_of_2(queries_per_kv)
    return dict(
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad(head_size),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=1 if cfg.decode else cfg.block_m // group_pad,
        BLOCK_N=cfg.block_n,
        BLOCK_R=REQUEST_SCAN_BLOCK,
        NUM_SPLITS=cfg.num_splits,
        SPLIT_MIN_TILES=cfg.min_tiles_per_split(),
        DECODE=cfg.decode,
        FP32_IEEE=dtype == torch.float32,
        FUSE_REDUCE=fuse_reduce,
    )
