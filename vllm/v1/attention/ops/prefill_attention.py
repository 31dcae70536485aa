"""Causal attention for prompts with no cached context, reading this step's K/V rows.

A step whose requests all start from position 0 (fresh prompts, no prefix-cache
hit) has every key and value it attends to in the step's own `key` / `value`
tensors, contiguous by token. This kernel reads them there through TMA tensor
descriptors (sm_90+) instead of gathering 16-token cache blocks through the
block table, so each K/V tile is one bulk copy into shared memory.

Work split:

    grid = ((num_tokens // BLOCK_Q + num_reqs) * num_kv_heads * HEAD_GROUPS,)
    program p: q block (longest causal range first), KV head, and which
        QUERIES_PER_KV / HEAD_GROUPS query heads of that KV head it serves
      rows = BLOCK_Q tokens x GROUP query heads = BLOCK_M rows of one tl.dot
      keys = tiles [0, first row) unmasked, then the diagonal tiles masked

Source: FlashAttention-2 (Dao, 2023, arXiv:2307.08691), the online softmax in
base 2; the two-phase causal loop follows Triton's fused-attention tutorial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm import envs
from vllm.v1.attention.ops.attention_config import (
    FRESH_PREFILL_CONFIG,
    FRESH_PREFILL_HEAD_SIZES,
    FRESH_PREFILL_MIN_QUERY_LEN,
    REQUEST_SCAN_BLOCK,
    FreshPrefillConfig,
    compute_capability,
)
from vllm.v1.attention.ops.unified_attention import _INTERPRETED

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_tile(q, k_desc, v_desc, m_i, l_i, acc, k_row, k_col, key0, q_tok, scale_log2,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    k = k_desc.load([k_row, k_col])
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        offs_n = key0 + tl.arange(0, BLOCK_N)
        s = tl.where(offs_n[None, :] <= q_tok[:, None], s, -1.0e6)
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = v_desc.load([k_row, k_col])
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _prefill_attention_kernel(
    q_desc,  # [num_tokens, num_heads, HEAD_SIZE], block [BLOCK_Q, GROUP, HEAD_SIZE]
    k_desc,  # [num_tokens, num_kv_heads * HEAD_SIZE], block [BLOCK_N, HEAD_SIZE]
    v_desc,
    output_ptr,  # [num_tokens, num_heads, HEAD_SIZE]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale_log2,
    num_tokens,
    num_reqs,
    stride_ot,
    stride_oh,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_GROUPS: tl.constexpr,  # programs per (q block, KV head)
    GROUP: tl.constexpr,  # query heads per program = QUERIES_PER_KV // HEAD_GROUPS
    HEAD_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
    per_qblock: tl.constexpr = NUM_KV_HEADS * HEAD_GROUPS
    pid = tl.num_programs(0) // per_qblock - 1 - tl.program_id(0) // per_qblock
    head_slot = tl.program_id(0) % per_qblock
    kv_head = head_slot // HEAD_GROUPS
    head0 = kv_head * QUERIES_PER_KV + (head_slot % HEAD_GROUPS) * GROUP

    req = tl.full([], -1, tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_valid = offs_r < num_reqs
        starts = tl.load(query_start_loc_ptr + offs_r, mask=r_valid, other=0)
        req += tl.sum((r_valid & (starts // BLOCK_Q + offs_r <= pid)).to(tl.int32), axis=0)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_off = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if q_off >= q_len:
        return

    q = q_desc.load([q_start + q_off, head0, 0])  # [BLOCK_Q, GROUP, HEAD_SIZE]
    q = tl.reshape(q, [BLOCK_M, HEAD_SIZE])  # row = token * GROUP + head
    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_off + offs_m // GROUP  # row -> token index within the request

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    k_col = kv_head * HEAD_SIZE
    # Key tiles wholly below the q block's first token: visible to every row.
    full_end = q_off - q_off % BLOCK_N
    for key0 in tl.range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, k_desc, v_desc, m_i, l_i, acc, q_start + key0, k_col,
                                      key0, q_tok, scale_log2, BLOCK_N, False)
    # The diagonal: tiles up to the block's last token, masked to each row's own token.
    diag_end = tl.minimum(q_off + BLOCK_Q, q_len)
    for key0 in range(full_end, diag_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, k_desc, v_desc, m_i, l_i, acc, q_start + key0, k_col,
                                      key0, q_tok, scale_log2, BLOCK_N, True)

    out = acc / l_i[:, None]
    head = head0 + offs_m % GROUP
    offs_d = tl.arange(0, HEAD_SIZE)
    rows = (q_start + q_tok).to(tl.int64)
    tl.store(
        output_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(output_ptr.dtype.element_ty),
        mask=(q_tok < q_len)[:, None],
    )


_FRESH_DTYPES = (torch.float16, torch.bfloat16)


def _has_tma(device: torch.device) -> bool:
    """TMA (tensor descriptors) needs sm_90 or newer; the interpreter emulates them."""
    if device.type != "cuda":
        return _INTERPRETED
    return compute_capability(device) >= (9, 0)


def _tma_ready(t: torch.Tensor) -> bool:
    """A TMA descriptor over t's rows: 16-byte aligned base and row stride, unit last stride."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.stride(-2) == t.shape[-1]
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * size) % 16 == 0
    )


def _enabled() -> bool:
    """Whether the engine may take this kernel: VLLM_FRESH_PREFILL_ATTENTION, 1 (the
    default) / true / on, or 0 / false / off (the paged kernel runs every prefill).

    Raises:
        ValueError: any other value (read at start-up warmup first).
    """
    return envs.VLLM_FRESH_PREFILL_ATTENTION


def fresh_prefill_supported(
    query: torch.Tensor | None, key: torch.Tensor | None, value: torch.Tensor
) -> bool:
    """Whether `prefill_attention` can run on these tensors: fp16/bf16, a head size
    in FRESH_PREFILL_HEAD_SIZES, sm_90+ (TMA), rows a descriptor can address
    (None: a tensor the caller allocates contiguous, which always can)."""
    return (
        value.dtype in _FRESH_DTYPES
        and value.shape[-1] in FRESH_PREFILL_HEAD_SIZES
        and _has_tma(value.device)
        and all(t is None or _tma_ready(t) for t in (query, key, value))
    )


def fresh_prefill_applies(
    max_query_len: int,
    query: torch.Tensor | None,
    key: torch.Tensor | None,
    value: torch.Tensor,
) -> bool:
    """Whether the engine runs a step of fresh prompts (no cached context) on
    `prefill_attention`: enabled (VLLM_FRESH_PREFILL_ATTENTION not 0), prompts of at
    least FRESH_PREFILL_MIN_QUERY_LEN tokens (shorter ones run on the paged
    kernel's small tiles) and `fresh_prefill_supported`. Host values only.
    """
    return (
        _enabled()
        and max_query_len >= FRESH_PREFILL_MIN_QUERY_LEN
        and fresh_prefill_supported(query, key, value)
    )


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
    config: FreshPrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of prompts with no cached context, from this step's K/V rows.

    Request i owns rows [query_start_loc[i], query_start_loc[i+1]) of query,
    key and value, and its token j attends to its keys 0..j.

    Args:
        query: [T, num_heads, head_size] fp16/bf16; heads and head_size
            contiguous, 16-byte aligned rows (see `fresh_prefill_applies`).
        key, value: [T, num_kv_heads, head_size], query's dtype, the same layout
            rules (rows may be strided slices of the qkv projection).
        output: [T, num_heads, head_size], query's dtype, last dim contiguous;
            rows of the requests are written, rows past query_start_loc[R] not.
        query_start_loc: [R + 1] int32, non-decreasing, query_start_loc[R] <= T.
        scale: softmax scale (usually head_size ** -0.5).
        config: tile override (benchmarks); None is FRESH_PREFILL_CONFIG.

    Returns:
        `output`.

    Raises:
        ValueError: shapes, dtypes, layouts or devices the kernel cannot take
            (the message names the tensor). No host sync.
    """
    cfg = config or FRESH_PREFILL_CONFIG
    num_tokens, num_heads, head_size = _check_inputs(query, key, value, output, query_start_loc)
    num_kv_heads = key.shape[1]
    num_reqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0:
        return output
    qpk = num_heads // num_kv_heads
    group = min(qpk & -qpk, cfg.max_group)  # query heads per program: a power of two dividing qpk
    block_q = cfg.block_m // group
    if block_q < 16 or block_q % 16:
        raise ValueError(f"block_m {cfg.block_m} leaves {block_q} tokens a program (>= 16)")

    q_desc = TensorDescriptor(query, list(query.shape), list(query.stride()),
                              [block_q, group, head_size])
    k_desc = TensorDescriptor(key, [num_tokens, num_kv_heads * head_size], [key.stride(0), 1],
                              [cfg.block_n, head_size])
    v_desc = TensorDescriptor(value, [num_tokens, num_kv_heads * head_size],
                              [value.stride(0), 1], [cfg.block_n, head_size])
    head_groups = qpk // group
    grid = ((num_tokens // block_q + num_reqs) * num_kv_heads * head_groups,)
    _prefill_attention_kernel[grid](
        q_desc, k_desc, v_desc, output, query_start_loc, scale * _LOG2E, num_tokens, num_reqs,
        output.stride(0), output.stride(1),
        NUM_KV_HEADS=num_kv_heads, QUERIES_PER_KV=qpk, HEAD_GROUPS=head_groups, GROUP=group,
        HEAD_SIZE=head_size, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, BLOCK_R=REQUEST_SCAN_BLOCK,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return output


def _check_inputs(query, key, value, output, query_start_loc):
    op = "prefill_attention"
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"{op}: query, key and value must be [num_tokens, heads, head_size], "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if key.shape != value.shape or key.shape[0] != num_tokens or key.shape[2] != head_size:
        raise ValueError(f"{op}: key and value must be [{num_tokens}, num_kv_heads, {head_size}], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[1] == 0 or num_heads % key.shape[1]:
        raise ValueError(f"{op}: query heads ({num_heads}) must be a multiple of key heads "
                         f"({key.shape[1]})")
    if output.shape != query.shape:
        raise ValueError(f"{op}: output shape {tuple(output.shape)} != query shape "
                         f"{tuple(query.shape)}")
    dtypes = {t.dtype for t in (query, key, value, output)}
    if len(dtypes) != 1 or query.dtype not in _FRESH_DTYPES:
        raise ValueError(f"{op}: query, key, value and output must share float16 or bfloat16, "
                         f"got {query.dtype}, {key.dtype}, {value.dtype}, {output.dtype}")
    if head_size not in FRESH_PREFILL_HEAD_SIZES:
        raise ValueError(f"{op}: head_size must be one of {FRESH_PREFILL_HEAD_SIZES}, "
                         f"got {head_size}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not _tma_ready(t):
            raise ValueError(f"{op}: {name} needs contiguous [heads, head_size] rows, a 16-byte "
                             f"aligned start and row stride, got strides {t.stride()}")
    if output.stride(-1) != 1:
        raise ValueError(f"{op}: output must have a contiguous last dim, got {output.stride()}")
    if (query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1
            or query_start_loc.shape[0] < 1 or query_start_loc.stride(0) != 1):
        raise ValueError(f"{op}: query_start_loc must be contiguous int32 [num_reqs + 1], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    devices = {t.device for t in (query, key, value, output, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"{op}: tensors must be on one device, got {devices}")
    if not _has_tma(query.device):
        raise ValueError(f"{op}: needs an sm_90+ CUDA device (TMA) or TRITON_INTERPRET=1, got "
                         f"{query.device}")
    return num_tokens, num_heads, head_size
