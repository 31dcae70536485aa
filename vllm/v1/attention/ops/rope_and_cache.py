"""Rotary embedding of query and key plus the KV cache write, in one Triton launch.

Per decoder layer this replaces two launches (`rotary_embedding`, then
`reshape_and_cache`) by one, and the rotated key never goes through global
memory as a separate tensor: it is rotated in registers and stored straight
into its cache slot.

    program t (one per token):
      p = positions[t];  c, s = cos_sin_cache[p] (cast to the query dtype)
      query_out[t]                              <- rope(query[t], c, s)
      slot = slot_mapping[t];  -1: no cache write (padding)
      kv_cache[slot // block_size, 0, slot % block_size] <- rope(key[t], c, s)
      kv_cache[slot // block_size, 1, slot % block_size] <- value[t]

The cos/sin load and the rotation are `vllm/model_executor/layers/ops/rotary.py`'s
`_rope_query` and `_rope_heads` (shared, so both kernels round alike: products
rounded to the input dtype before the sum, no FMA contraction). The reference
is the composition of the two references: `RotaryEmbedding.forward_native` then
`reshape_and_cache_ref` (`rope_and_cache_ref` below); bf16/fp16/fp32 outputs
equal it exactly where the device rounds as the CPU does.

As `reshape_and_cache`, only slot -1 is skipped and no bound derived from the
cache view is applied (see that module: a bound would be baked into captured
graphs while the extensible cache grows under them). The grid depends only on
the number of tokens, so the launch is CUDA-graph capturable; no host sync.

Rejected: folding the rotation into the attention kernel's query load (the
decode kernel runs once per KV split and per GQA group, so the query would be
rotated many times, and the key still has to be written before attention
reads it); writing the rotated key to a tensor and the cache both in every
step (one more store of every key for nothing: the paged kernel reads keys from
the cache). Only a fresh prefill asks for `key_out`: its attention reads this
step's keys contiguously (`prefill_attention.py`), and one extra store of each
key costs far less than gathering them back through the block table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import check_dtype, check_last_dim_contiguous, check_same_device
from vllm.model_executor.layers.ops.rotary import (
    _rope_heads,
    _rope_query,
    check_positions,
    check_rotary_dim,
    rope_tiles,
)


@triton.jit
def _rope_and_cache_kernel(
    positions_ptr,  # [num_tokens] int32/int64
    query_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE], last dim contiguous
    key_ptr,  # [num_tokens, NUM_KV_HEADS * HEAD_SIZE], last dim contiguous
    value_ptr,  # [num_tokens, NUM_KV_HEADS * HEAD_SIZE], last dim contiguous
    cos_sin_ptr,  # [max_position, ROTARY_DIM] = cos | sin, last dim contiguous
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE] (heads contiguous)
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    query_out_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE] contiguous
    key_out_ptr,  # [num_tokens, NUM_KV_HEADS * HEAD_SIZE] contiguous (WRITE_KEY)
    stride_pos,
    stride_q,  # row strides, elements
    stride_k,
    stride_v,
    stride_cache,
    stride_cb,  # kv_cache strides in elements: block, K/V, slot in block
    stride_ckv,
    stride_cs,
    max_position,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= ROTARY_DIM // 2
    PASS_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE - ROTARY_DIM (1 if none)
    KV_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_SIZE
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    WRITE_KEY: tl.constexpr,  # also store the rotated key rows into key_out
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _rope_query(token, positions_ptr, cos_sin_ptr, query_ptr, query_out_ptr,
                           stride_pos, stride_q, stride_cache, max_position, NUM_Q_HEADS,
                           HEAD_SIZE, ROTARY_DIM, HALF_PAD, PASS_PAD, BLOCK_HQ, IS_NEOX)
    if WRITE_KEY:
        _rope_heads(key_ptr + token * stride_k, key_out_ptr + token * (NUM_KV_HEADS * HEAD_SIZE),
                    cos, sin, NUM_KV_HEADS, HEAD_SIZE, ROTARY_DIM, HALF_PAD, PASS_PAD, BLOCK_HK,
                    IS_NEOX)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        _rope_heads(key_ptr + token * stride_k, dst, cos, sin, NUM_KV_HEADS, HEAD_SIZE,
                    ROTARY_DIM, HALF_PAD, PASS_PAD, BLOCK_HK, IS_NEOX)
        offs_v = tl.arange(0, KV_PAD)
        v_mask = offs_v < NUM_KV_HEADS * HEAD_SIZE
        v = tl.load(value_ptr + token * stride_v + offs_v, mask=v_mask)
        tl.store(dst + stride_ckv + offs_v, v, mask=v_mask)


def rope_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox_style: bool = True,
    key_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate query and key by their positions and write key/value into the cache, one launch.

    Args:
        positions: [T] int32/int64 token positions, each in [0, max_position).
        query: [T, num_heads * head_size], last dim contiguous, any row stride.
        key, value: [T, num_kv_heads * head_size], query's dtype, last dim
            contiguous, any row stride (slices of the qkv projection).
        cos_sin_cache: [max_position, rotary_dim] = cos | sin, float16/bfloat16/
            float32; rotary_dim even and <= head_size.
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_size], query's
            dtype, the last two dims contiguous; block_size a power of two.
        slot_mapping: [T] int64, contiguous; -1 writes nothing.
        is_neox_style: rotate halves (True) or interleaved pairs.
        key_out: optional contiguous [T, num_kv_heads * head_size] of the key's
            dtype that also receives the rotated key rows (every row, padding
            included): the fresh-prefill attention reads keys from it.

    Returns:
        query_out: new contiguous [T, num_heads * head_size], the rotated query.
        The cache (and key_out) are written in place; key and value are not modified.

    Raises:
        ValueError: dtypes, shapes, strides or devices that do not fit (numbers given).
    """
    rotary_dim, head_size = _check_inputs(
        positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping, key_out
    )
    num_tokens = positions.shape[0]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return query_out
    num_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
    half_pad, pass_pad, block_hq, block_hk = rope_tiles(num_heads, num_kv_heads, head_size,
                                                        rotary_dim)
    _rope_and_cache_kernel[(num_tokens,)](
        positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping, query_out,
        query_out if key_out is None else key_out,
        positions.stride(0), query.stride(0), key.stride(0), value.stride(0),
        cos_sin_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        cos_sin_cache.shape[0],
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        ROTARY_DIM=rotary_dim, HALF_PAD=half_pad, PASS_PAD=pass_pad,
        KV_PAD=triton.next_power_of_2(num_kv_heads * head_size), BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, IS_NEOX=is_neox_style, WRITE_KEY=key_out is not None,
        num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: round products where torch does
    )
    return query_out


def _check_inputs(positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping, key_out):
    """Validate; returns (rotary_dim, head_size)."""
    op = "rope_and_cache"
    _check_key_out(key, key_out)
    num_kv_heads, head_size = _check_kv_cache(op, kv_cache)
    num_tokens = check_positions(op, positions)
    for name, t, heads in (("query", query, None), ("key", key, num_kv_heads),
                           ("value", value, num_kv_heads)):
        check_dtype(op, name, t)
        width = t.shape[1] if t.dim() == 2 else -1
        if t.dim() != 2 or t.shape[0] != num_tokens or width % head_size or not width or (
            heads is not None and width != heads * head_size
        ):
            want = "heads" if heads is None else heads
            raise ValueError(
                f"{op}: {name} must be [{num_tokens}, {want} * {head_size}] (num_tokens = "
                f"positions.shape[0], heads and head_size from kv_cache), got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise ValueError(
                f"{op}: {name} must have the cache's dtype {kv_cache.dtype}, got {t.dtype}"
            )
    check_last_dim_contiguous(op, query=query, key=key, value=value)
    rotary_dim = check_rotary_dim(op, cos_sin_cache, head_size)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError(f"{op}: cos_sin_cache must have a contiguous last dim")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,) or (
        num_tokens > 1 and slot_mapping.stride(0) != 1
    ):
        raise ValueError(
            f"{op}: slot_mapping must be contiguous int64 [{num_tokens}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    check_same_device(
        op, positions=positions, query=query, key=key, value=value,
        cos_sin_cache=cos_sin_cache, kv_cache=kv_cache, slot_mapping=slot_mapping,
    )
    return rotary_dim, head_size


def _check_kv_cache(op: str, kv_cache: torch.Tensor) -> tuple[int, int]:
    """[num_blocks, 2, block_size (a power of two), num_kv_heads, head_size] with contiguous
    [num_kv_heads, head_size] rows; returns (num_kv_heads, head_size)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{op}: kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    if block_size & (block_size - 1):
        raise ValueError(f"{op}: kv_cache block_size must be a power of two, got {block_size}")
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_size:
        raise ValueError(
            f"{op}: kv_cache must have contiguous [num_kv_heads, head_size] rows, got strides "
            f"{kv_cache.stride()}"
        )
    return num_kv_heads, head_size


def _check_key_out(key: torch.Tensor, key_out: torch.Tensor | None) -> None:
    """None, or a contiguous tensor of key's shape, dtype and device."""
    if key_out is not None and (
        key_out.shape != key.shape or key_out.dtype != key.dtype
        or key_out.device != key.device or not key_out.is_contiguous()
    ):
        raise ValueError(
            f"rope_and_cache: key_out must be contiguous {key.dtype} {tuple(key.shape)} on "
            f"{key.device}, got {key_out.dtype} {tuple(key_out.shape)} on {key_out.device}"
        )


def rope_and_cache_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary_emb,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Plain-torch reference: `rotary_emb.forward_native`, then `reshape_and_cache_ref`.

    rotary_emb is a `RotaryEmbedding`; same contract as `rope_and_cache`.
    """
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache_ref

    num_tokens, head_size = positions.shape[0], kv_cache.shape[4]
    q, k = rotary_emb.forward_native(positions, query, key)
    reshape_and_cache_ref(
        k.reshape(num_tokens, -1, head_size),
        value.reshape(num_tokens, -1, head_size),
        kv_cache,
        slot_mapping,
    )
    return q.contiguous()
