"""Write this step's new keys and values into the paged KV cache by slot mapping.

    key/value rows:  t = 0 .. T-1, each [num_kv_heads, head_size]
    slot_mapping[t] = block_id * block_size + offset       (-1: padding, write nothing)

    kv_cache[block_id, 0, offset] <- key[t]        (K half of the block)
    kv_cache[block_id, 1, offset] <- value[t]      (V half of the block)

One program per (token, head tile) copies the token's heads; the grid depends
only on the number of tokens, so the launch is CUDA-graph capturable.

Only slot -1 is skipped; there is deliberately NO upper bound from
`kv_cache.shape[0]`. With the extensible cache the per-layer view covers the
blocks committed *when a graph is captured* (two, during warmup); any bound
derived from it would be baked into the graph and silently drop every write
to a block committed later. Slots come from the scheduler's block table, which
only hands out committed blocks; keeping them in range is its invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements one program copies per K (and per V): head tiles of at most this size.
_MAX_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, HEAD_SIZE]
    value_ptr,  # [num_tokens, num_kv_heads, HEAD_SIZE]
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # kv_cache strides in elements: block, K/V, slot in block, head
    stride_ckv,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_H: tl.constexpr,  # heads per program (power of two)
):
    token = tl.program_id(0)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_SIZE)[None, :]
    t64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    dst = kv_cache_ptr + block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch
    dst = dst + offs_d[None, :]
    tl.store(dst, key, mask=mask)
    tl.store(dst + stride_ckv, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter `key`/`value` rows into `kv_cache` at `slot_mapping` (in place).

    Args:
        key, value: [T, num_kv_heads, head_size], dtype of the cache, last dim contiguous.
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_size], last dim
            contiguous; block_size a power of two.
        slot_mapping: [T] int64 on the same device; -1 writes nothing. Other
            slots must address blocks of the cache (not checked: see above).

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit (numbers given).
    """
    _check_inputs(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    head_pad = max(triton.next_power_of_2(head_size), 16)
    block_h = min(
        triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS_PER_PROGRAM // head_pad)
    )
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_H=block_h,
        num_warps=4 if block_h * head_pad >= 1024 else 1,
    )


def _check_inputs(key, value, kv_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads, head_size] and value the same shape, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[3:]) != key.shape[1:]:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, {key.shape[1]}, {key.shape[2]}], "
            f"got {tuple(kv_cache.shape)}"
        )
    block_size = kv_cache.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"kv_cache block_size must be a power of two, got {block_size}")
    if key.dtype not in _SUPPORTED_DTYPES or {value.dtype, kv_cache.dtype} != {key.dtype}:
        raise ValueError(
            f"key, value and kv_cache must share one of {_SUPPORTED_DTYPES}, got key "
            f"{key.dtype}, value {value.dtype}, kv_cache {kv_cache.dtype}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride(0)}")
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    devices = {key.device, value.device, kv_cache.device, slot_mapping.device}
    if len(devices) != 1:
        raise ValueError(
            f"key, value, kv_cache and slot_mapping must be on one device, got {devices}"
        )


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Plain-torch reference of `reshape_and_cache`, same semantics (in place)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep]
    kv_cache[blocks, 1, offsets] = value[keep]
