"""Rotary embedding of query and key in one Triton launch.

For token t at position p = positions[t], with c = cos_sin_cache[p, :R/2] and
s = cos_sin_cache[p, R/2:] cast to the query dtype (R = rotary_dim), every
head of query and key is rotated pair by pair:

    neox (HF Llama/Qwen):  a = x[i],    b = x[i + R/2]     i < R/2
    gptj (interleaved):    a = x[2i],   b = x[2i + 1]
    a' = a*c - b*s,   b' = b*c + a*s,   features R .. head_size-1 copied unchanged

As `RotaryEmbedding.forward_native` (vllm/model_executor/layers/
rotary_embedding.py, the reference): each product is rounded to the input
dtype before the sum, as torch's separate ops do, so outputs match it exactly
when the device rounds like the CPU (float32 products and sums, rounded to
nearest even). Llama 3 scaling only changes the cache, not this step.

    query [T, num_heads * head_size]   row stride free (a slice of the qkv output)
    key   [T, num_kv_heads * head_size]
    program t: load p, c, s once; rotate the query heads in tiles of BLOCK_HQ
               heads, then the key heads in tiles of BLOCK_HK; write new rows

Outputs are new contiguous tensors (the reference's contract: inputs are not
modified). A position outside [0, max_position) reads no memory: its rotated
features come out NaN (a host check would need a sync, which a captured
graph cannot have; the reference raises an index error instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)

# Elements of one (heads x R/2) tile: two such tiles (a and b) live in registers.
_MAX_TILE_ELEMENTS = 2048


@triton.jit
def _rope_heads(
    src_ptr,  # first element of this token's [NUM_HEADS, HEAD_SIZE] row in the input
    dst_ptr,  # same, in the output
    cos,  # [HALF_PAD] float32 holding values of the output dtype
    sin,  # [HALF_PAD] float32 holding values of the output dtype
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= ROTARY_DIM // 2
    PASS_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE - ROTARY_DIM (1 if none)
    BLOCK_H: tl.constexpr,  # heads per tile
    IS_NEOX: tl.constexpr,
):
    half = ROTARY_DIM // 2
    dtype = dst_ptr.dtype.element_ty
    offs_i = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        idx_a = offs_i
        idx_b = offs_i + half
    else:
        idx_a = 2 * offs_i
        idx_b = 2 * offs_i + 1
    c = cos[None, :]
    s = sin[None, :]
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        head = offs_h[:, None] * HEAD_SIZE
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_i < half)[None, :]
        a = tl.load(src_ptr + head + idx_a[None, :], mask=mask, other=0).to(tl.float32)
        b = tl.load(src_ptr + head + idx_b[None, :], mask=mask, other=0).to(tl.float32)
        ac = (a * c).to(dtype).to(tl.float32)
        bs = (b * s).to(dtype).to(tl.float32)
        bc = (b * c).to(dtype).to(tl.float32)
        as_ = (a * s).to(dtype).to(tl.float32)
        tl.store(dst_ptr + head + idx_a[None, :], (ac - bs).to(dtype), mask=mask)
        tl.store(dst_ptr + head + idx_b[None, :], (bc + as_).to(dtype), mask=mask)
        if ROTARY_DIM < HEAD_SIZE:
            offs_p = ROTARY_DIM + tl.arange(0, PASS_PAD)
            pass_mask = (offs_h < NUM_HEADS)[:, None] & (offs_p < HEAD_SIZE)[None, :]
            rest = tl.load(src_ptr + head + offs_p[None, :], mask=pass_mask)
            tl.store(dst_ptr + head + offs_p[None, :], rest, mask=pass_mask)


@triton.jit
def _load_cos_sin(
    positions_ptr,  # [num_tokens] int32/int64
    cos_sin_ptr,  # [max_position, ROTARY_DIM] = cos | sin, last dim contiguous
    out_ptr,  # the rotated output: its dtype is the one cos and sin are rounded to
    token,  # int64 program's token
    stride_pos,
    stride_cache,
    max_position,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """(cos, sin) [HALF_PAD] float32 of `token`'s position, rounded to the output dtype
    first, as the reference's `.to(query.dtype)`; NaN for a position outside
    [0, max_position) (no memory is read for it)."""
    half = ROTARY_DIM // 2
    pos = tl.load(positions_ptr + token * stride_pos).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    # pos as a vector: the interpreter mishandles a scalar & a block mask.
    pos_i = pos + tl.zeros([HALF_PAD], dtype=tl.int64)
    cache_mask = (offs_i < half) & (pos_i >= 0) & (pos_i < max_position)
    cache_row = cos_sin_ptr + pos * stride_cache
    dtype = out_ptr.dtype.element_ty
    cos = tl.load(cache_row + offs_i, mask=cache_mask, other=float("nan"))
    sin = tl.load(cache_row + half + offs_i, mask=cache_mask, other=float("nan"))
    return cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)


@triton.jit
def _rope_query(
    token,  # int64 program's token
    positions_ptr,
    cos_sin_ptr,
    query_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE], last dim contiguous
    query_out_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE] contiguous
    stride_pos,
    stride_q,
    stride_cache,
    max_position,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """The start of every RoPE kernel's program: load the token's cos and sin, write its
    rotated query row; returns (cos, sin) for the key."""
    cos, sin = _load_cos_sin(positions_ptr, cos_sin_ptr, query_out_ptr, token, stride_pos,
                             stride_cache, max_position, ROTARY_DIM, HALF_PAD)
    _rope_heads(query_ptr + token * stride_q, query_out_ptr + token * (NUM_Q_HEADS * HEAD_SIZE),
                cos, sin, NUM_Q_HEADS, HEAD_SIZE, ROTARY_DIM, HALF_PAD, PASS_PAD, BLOCK_HQ,
                IS_NEOX)
    return cos, sin


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,  # [num_tokens] int32/int64
    query_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE], last dim contiguous
    key_ptr,  # [num_tokens, NUM_KV_HEADS * HEAD_SIZE], last dim contiguous
    cos_sin_ptr,  # [max_position, ROTARY_DIM] = cos | sin, last dim contiguous
    query_out_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE] contiguous
    key_out_ptr,  # [num_tokens, NUM_KV_HEADS * HEAD_SIZE] contiguous
    stride_pos,
    stride_q,  # row strides, elements
    stride_k,
    stride_cache,
    max_position,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _rope_query(token, positions_ptr, cos_sin_ptr, query_ptr, query_out_ptr,
                           stride_pos, stride_q, stride_cache, max_position, NUM_Q_HEADS,
                           HEAD_SIZE, ROTARY_DIM, HALF_PAD, PASS_PAD, BLOCK_HQ, IS_NEOX)
    _rope_heads(key_ptr + token * stride_k, key_out_ptr + token * (NUM_KV_HEADS * HEAD_SIZE),
                cos, sin, NUM_KV_HEADS, HEAD_SIZE, ROTARY_DIM, HALF_PAD, PASS_PAD, BLOCK_HK,
                IS_NEOX)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every head of query and key by its token's position, one launch.

    Args:
        positions: [T] int32/int64 token positions, each in [0, max_position).
        query: [T, num_heads * head_size], last dim contiguous, any row stride.
        key: [T, num_kv_heads * head_size], query's dtype, last dim contiguous.
        cos_sin_cache: [max_position, rotary_dim] = cos | sin, float16/bfloat16/
            float32, last dim contiguous; rotary_dim even and <= head_size.
        head_size: features per head.
        is_neox_style: rotate halves (True) or interleaved pairs.

    Returns:
        (query_out, key_out): new contiguous tensors, shapes and dtype of query/key.

    Raises:
        ValueError: dtypes, shapes, strides or devices that do not fit (numbers given).
    """
    rotary_dim = _check_inputs(positions, query, key, cos_sin_cache, head_size)
    num_tokens = positions.shape[0]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    num_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
    half_pad, pass_pad, block_hq, block_hk = rope_tiles(num_heads, num_kv_heads, head_size,
                                                        rotary_dim)
    _rotary_embedding_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, query_out, key_out,
        positions.stride(0), query.stride(0), key.stride(0), cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        ROTARY_DIM=rotary_dim, HALF_PAD=half_pad, PASS_PAD=pass_pad,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, IS_NEOX=is_neox_style,
        num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: round products where torch does
    )
    return query_out, key_out


def rope_tiles(
    num_heads: int, num_kv_heads: int, head_size: int, rotary_dim: int
) -> tuple[int, int, int, int]:
    """(HALF_PAD, PASS_PAD, BLOCK_HQ, BLOCK_HK) of a `_rope_heads` launch: the padded
    rotated half, the padded pass-through part (1 if none) and the heads per tile of
    query and key (a tile of heads x HALF_PAD stays within _MAX_TILE_ELEMENTS)."""
    half_pad = triton.next_power_of_2(rotary_dim // 2)
    heads_per_tile = max(1, _MAX_TILE_ELEMENTS // half_pad)
    return (
        half_pad,
        triton.next_power_of_2(max(head_size - rotary_dim, 1)),
        min(triton.next_power_of_2(num_heads), heads_per_tile),
        min(triton.next_power_of_2(num_kv_heads), heads_per_tile),
    )


def _check_inputs(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> int:
    """Validate; returns rotary_dim."""
    op = "rotary_embedding"
    num_tokens = check_positions(op, positions)
    for name, t in (("query", query), ("key", key)):
        check_dtype(op, name, t)
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] % head_size or not t.shape[1]:
            raise ValueError(
                f"{op}: {name} must be [{num_tokens}, heads * {head_size}] (num_tokens = "
                f"positions.shape[0]), got {tuple(t.shape)}"
            )
    check_last_dim_contiguous(op, query=query, key=key)
    if key.dtype != query.dtype:
        raise ValueError(f"{op}: key must have query's dtype {query.dtype}, got {key.dtype}")
    rotary_dim = check_rotary_dim(op, cos_sin_cache, head_size)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"{op}: cos_sin_cache must have a contiguous last dim, got strides "
            f"{cos_sin_cache.stride()}"
        )
    check_same_device(op, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    return rotary_dim


def check_positions(op: str, positions: torch.Tensor) -> int:
    """Raise ValueError unless positions is [num_tokens] int32/int64; returns num_tokens."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: positions must be [num_tokens] int32/int64, got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    return positions.shape[0]


def check_rotary_dim(op: str, cos_sin_cache: torch.Tensor, head_size: int) -> int:
    """Raise ValueError unless cos_sin_cache is [max_position, rotary_dim] of a supported
    dtype, rotary_dim even and <= head_size; returns rotary_dim (strides: the caller's)."""
    check_dtype(op, "cos_sin_cache", cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(
            f"{op}: cos_sin_cache must be [max_position, rotary_dim] with rotary_dim even and "
            f"<= head_size ({head_size}), got {tuple(cos_sin_cache.shape)}"
        )
    return rotary_dim
