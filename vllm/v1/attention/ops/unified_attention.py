"""One paged-attention kernel for a batch that mixes prefills and decodes.

The batch is flattened (see `backends/abstract.py`): request i owns query rows
[query_start_loc[i], query_start_loc[i+1]), has seq_lens[i] keys in the cache
(its cached context plus its q_i new tokens, already written by
`reshape_and_cache`), and its token j attends causally to keys
0 .. seq_lens[i] - q_i + j through block_table[i].

Work split (all from shapes, so one launch is CUDA-graph capturable):

    grid = ((num_tokens // BLOCK_Q + num_reqs) * num_kv_heads,  NUM_SPLITS)
              q blocks x GQA groups (KV head fastest)           KV ranges

    program (p * num_kv_heads + g, s): request i = the last one with
        query_start_loc[i] // BLOCK_Q + i <= p      (found in-kernel; that value is
                                                    request i's first q-block id)
      rows = BLOCK_Q tokens of request i  x  the GROUP_PAD query heads of KV head g
           = BLOCK_M rows of one tl.dot, so every K/V tile is read once per group
      keys = split s of the causal range, tiles of BLOCK_N tokens gathered from
             BLOCK_N / block_size cache blocks through the block table

      loop = `_attend_tiles` twice: tiles wholly below the first row's causal limit
             unmasked (the bulk of a long prefill), then the few crossing it, masked
      order = program 0 takes the LAST q block (the longest causal range first)

    sum_i cdiv(q_i, BLOCK_Q) <= num_tokens // BLOCK_Q + num_reqs, so the first grid
    dimension covers every q block of any batch of that shape; spare programs
    exit at once. The KV head varies fastest so that programs running side by
    side read neighbouring heads of the same token rows (one 2 KiB row of a
    block for Llama-3-8B) rather than 256-byte pieces of unrelated blocks.

    DECODE (max_query_len == 1, the decode CUDA graphs): BLOCK_Q = 1 and
    grid = (max(num_tokens, num_reqs) * num_kv_heads, NUM_SPLITS); program p
    serves request p (no search: its start, length and key count load in one
    round trip) and zeroes flat token p if it is padding; the tiles run in one
    masked loop, so the K/V pipeline has one prologue. A split takes at least
    SPLIT_MIN_TILES tiles, so a short range leaves the higher splits idle.

NUM_SPLITS > 1 is flash-decoding: each split keeps its own running max m, sum l
and unnormalised accumulator in an fp32 workspace, and they are combined as
out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. A DECODE launch of up to
FUSED_REDUCE_MAX_SPLITS splits combines them in its own last split to finish
(FUSE_REDUCE): a split past the rows' last key tile leaves at once; a single
active split writes the output itself; otherwise each active split bumps an int32
counter at the workspace's front (one per program of grid dim 0) after its stores,
and the one that brings it to the number of active splits reduces their rows in
split order and resets the counter to 0, so such a decode layer is one launch
(0.4-0.7 us a layer less on an H100; a small model's batch-1 step launched 30
`_reduce_splits_kernel`s, issue 10). Other launches run
`_reduce_splits_kernel` after the attention kernel. The "last block reduces"
pattern is the CUDA samples' threadFenceReduction (there a __threadfence, here a
CTA barrier before one thread's acq_rel gpu-scope atomic: release cumulativity
carries the other threads' stores, ordered before it by the barrier).

Graph-capture rules: the grid, the tile config and NUM_SPLITS depend only on
tensor shapes and on the host bounds max_query_len / max_seq_len (which a
captured graph fixes at their upper bounds); the kernel reads query_start_loc
and seq_lens from device memory, so a replay with smaller values is correct.
Rows past query_start_loc[num_reqs] (padding tokens) are written with zeros;
requests with seq_len 0 and no tokens do nothing; nothing syncs with the host.

Softmax runs in fp32 in base 2 (scores scaled by scale * log2(e)); rows whose
causal range is empty produce zeros. Source of the online softmax and of the
split-KV reduction: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) and
Flash-Decoding (Dao, Haziza, Massa, Sizov, PyTorch blog, October 2023).
The launcher's host side (checks, tiles, grid, workspace): `unified_attention_launch.py`.

Rejected alternatives:
  * separate prefill and decode kernels: two code paths to keep equal, and a
    mixed batch would need two launches split by a host-side classification;
  * a grid of num_reqs x cdiv(max_query_len, BLOCK_Q): depends on a per-step
    value in eager mode and wastes programs on decodes in mixed batches;
  * a binary search for the program's request: log2(num_reqs) dependent loads;
    one vector load of REQUEST_SCAN_BLOCK starts and a count is a single round trip;
  * a host-built q-block -> request map: one more per-step tensor in the
    metadata contract, for what the kernel derives from query_start_loc.
On sm_90, Triton 3.6 keeps one K/V buffer for the 16-row (mma.sync) decode
tiles whatever num_stages says; the bytes in flight come from occupancy
instead (122 registers: 4 programs of 32 KiB tiles per SM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.v1.attention.ops.attention_config import (
    AttentionKernelConfig,
    head_pad,
    split_counters_numel,
)
from vllm.v1.attention.ops.unified_attention_launch import (
    INTERPRETED as _INTERPRETED,  # noqa: F401 (prefill_attention.py imports it from here)
)
from vllm.v1.attention.ops.unified_attention_launch import (
    check_inputs,
    choose_config,
    fuses_reduce,
    kernel_constexprs,
    launch_grid,
    split_workspace,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    q,  # [BLOCK_M, HEAD_PAD] query rows of this program
    m_i,  # [BLOCK_M] fp32 running max (base 2)
    l_i,  # [BLOCK_M] fp32 running sum
    acc,  # [BLOCK_M, HEAD_PAD] fp32 unnormalised output
    tile_begin,
    tile_end,  # key tiles [tile_begin, tile_end) of BLOCK_N keys
    kv_end,  # keys past this are not read (masked tiles only)
    key_limit,  # [BLOCK_M] row r attends to keys [0, key_limit[r]) (masked tiles only)
    block_row_ptr,  # this request's block-table row
    kv_cache_ptr,
    kv_head,
    max_blocks_per_req,
    scale_log2,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    offs_d,  # [HEAD_PAD]
    d_valid,  # [HEAD_PAD] offs_d < HEAD_SIZE
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of every tile is visible to every row
):
    """Online softmax over key tiles; returns the updated (m_i, l_i, acc).

    The unmasked variant loads K/V and block ids without length masks and skips
    the causal select (the bulk of a long prefill's tiles); MASKED handles the
    tiles that cross a row's causal limit or the end of the keys.
    """
    for tile in range(tile_begin, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        logical_block = offs_n // BLOCK_SIZE
        if MASKED:
            n_valid = offs_n < kv_end
            block_id = tl.load(
                block_row_ptr + logical_block,
                mask=n_valid & (logical_block < max_blocks_per_req),
                other=0,
            ).to(tl.int64)
        else:
            block_id = tl.load(block_row_ptr + logical_block).to(tl.int64)
        kv_off = block_id * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        # K and V share one [BLOCK_N, HEAD_PAD] address tensor (each row HEAD_SIZE
        # contiguous elements); the QK^T dot takes K transposed.
        kv_ptrs = kv_cache_ptr + kv_off[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0)
        elif HEAD_PAD == HEAD_SIZE:
            k = tl.load(kv_ptrs)
            v = tl.load(kv_ptrs + stride_ckv)
        else:
            k = tl.load(kv_ptrs, mask=d_valid[None, :], other=0.0)
            v = tl.load(kv_ptrs + stride_ckv, mask=d_valid[None, :], other=0.0)
        if FP32_IEEE:  # fp32 inputs: exact products, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MASKED:
            causal = (offs_n[None, :] < key_limit[:, None]) & n_valid[None, :]
            s = tl.where(causal, s, float("-inf"))
        # The softmax scale is folded into the max and the exponent (scale > 0), so
        # the scores are scaled inside one multiply-add rather than a pass of their own.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        else:
            m_use = m_new  # an unmasked tile gives every row a finite score
        p = tl.exp2(s * scale_log2 - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


# num_tokens and num_reqs change every step: specialising on them (Triton
# compiles a variant for value 1 and for multiples of 16) would compile on
# the request path whenever a step falls in a class not seen yet (issue 10).
@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _unified_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, HEAD_SIZE]
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    output_ptr,  # [num_tokens, num_heads, HEAD_SIZE]
    ws_acc_ptr,  # [NUM_SPLITS, num_tokens, num_heads, HEAD_PAD] fp32 (NUM_SPLITS > 1)
    ws_ml_ptr,  # [NUM_SPLITS, num_tokens, num_heads, 2] fp32: running max, sum
    counters_ptr,  # [grid dim 0] int32, zero between launches (FUSE_REDUCE)
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_table_ptr,  # [>= num_reqs, max_blocks_per_req] int32
    scale_log2,  # softmax scale * log2(e)
    num_tokens,
    num_reqs,
    num_heads,
    num_kv_heads,
    max_blocks_per_req,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # kv_cache strides in elements: block, K/V, slot in block, head
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,  # GQA group size
    GROUP_PAD: tl.constexpr,  # next power of two >= QUERIES_PER_KV
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE (and >= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows per program >= BLOCK_Q * GROUP_PAD (the rest are dead)
    BLOCK_Q: tl.constexpr,  # query tokens per program (1 when DECODE)
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_R: tl.constexpr,  # requests per step of the request search
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,  # a split takes at least this many tiles (fewer splits run)
    DECODE: tl.constexpr,  # every q_i <= 1: program p serves request p, no search
    FP32_IEEE: tl.constexpr,  # fp32 inputs: full-precision dots
    FUSE_REDUCE: tl.constexpr,  # (NUM_SPLITS > 1) the last split to finish reduces
):
    if DECODE:
        pid = tl.program_id(0) // num_kv_heads  # request pid, and flat token pid if padding
    else:
        # q block, longest causal range first: program 0 takes the last q block of
        # the last request, so the short blocks of prompt starts fill the tail of
        # the launch instead of the longest ones running alone at its end.
        pid = tl.num_programs(0) // num_kv_heads - 1 - tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    split = tl.program_id(1)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok_in_block = offs_m // GROUP_PAD  # row -> query token within the q block
    head_in_group = offs_m % GROUP_PAD  # row -> query head within the GQA group
    head = kv_head * QUERIES_PER_KV + head_in_group
    head_valid = (head_in_group < QUERIES_PER_KV) & (tok_in_block < BLOCK_Q)
    d_valid = offs_d < HEAD_SIZE
    if DECODE:
        # One request per program: its start, length and keys are loaded at once,
        # with the token count, before any branch (each branch on a loaded value
        # would put one more memory round trip in front of the first K/V tile).
        req = tl.minimum(pid, num_reqs - 1)  # programs past the requests leave below
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req)
    num_real_tokens = tl.load(query_start_loc_ptr + num_reqs)

    # Padding rows (past the last request's tokens) get zeros: program p covers
    # flat rows [p * BLOCK_Q, (p + 1) * BLOCK_Q), and the grid reaches past num_tokens.
    if (split == 0) & (pid * BLOCK_Q + BLOCK_Q > num_real_tokens):
        pad_tok = pid * BLOCK_Q + tok_in_block
        pad = (pad_tok >= num_real_tokens) & (pad_tok < num_tokens) & head_valid
        pad_ptrs = (
            output_ptr
            + pad_tok.to(tl.int64)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :]
        )
        zeros = tl.zeros([BLOCK_M, HEAD_PAD], dtype=output_ptr.dtype.element_ty)
        tl.store(pad_ptrs, zeros, mask=pad[:, None] & d_valid[None, :])

    if DECODE:
        if pid >= num_reqs:
            return
        q_off = 0
    else:
        # Which request does q block `pid` belong to? Count requests whose first
        # q-block id (query_start_loc[i] // BLOCK_Q + i, strictly increasing) is <= pid.
        req = tl.full([], -1, tl.int32)
        for r0 in range(0, num_reqs, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_valid = offs_r < num_reqs
            starts = tl.load(query_start_loc_ptr + offs_r, mask=r_valid, other=0)
            first_qblock = starts // BLOCK_Q + offs_r
            req += tl.sum((r_valid & (first_qblock <= pid)).to(tl.int32), axis=0)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_off = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first token of this q block
        seq_len = tl.load(seq_lens_ptr + req)
    if q_off >= q_len:
        return

    context_len = seq_len - q_len
    q_pos = q_off + tok_in_block  # row -> index among the request's new tokens
    row_valid = (q_pos < q_len) & head_valid
    q_tok = (q_start + q_pos).to(tl.int64)
    key_limit = context_len + q_pos + 1  # row attends to keys [0, key_limit)

    # Keys this q block needs, cut into tiles; split s takes a contiguous run of tiles.
    kv_end = tl.minimum(context_len + tl.minimum(q_off + BLOCK_Q, q_len), seq_len)
    kv_end = tl.maximum(kv_end, 0)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    # NUM_SPLITS is chosen for the longest range a launch may hold (under a CUDA
    # graph, max_model_len); a shorter range runs on fewer splits of at least
    # SPLIT_MIN_TILES tiles each; an idle split stores (max -inf, sum 0, zeros),
    # which the reduce weighs 0, or with FUSE_REDUCE leaves without a store.
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), SPLIT_MIN_TILES)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    num_active = NUM_SPLITS  # splits whose partials are combined
    if FUSE_REDUCE:
        # Splits past the range's last tile have nothing to add: they leave now, and
        # only the active splits count towards the reduce (a single active split
        # writes the output itself, as NUM_SPLITS == 1 does).
        num_active = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
        if split >= num_active:
            return

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    if tile_lo < tile_hi:
        q = tl.load(
            query_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
        # Tiles below every row's causal limit (the first row's is the lowest) need
        # no causal or length mask: only the last few tiles of the range do.
        full_end = tl.minimum((context_len + q_off + 1) // BLOCK_N, tile_hi)
        if DECODE:  # one masked loop: a single pipeline over every tile (one prologue)
            full_end = tile_lo
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, tile_lo, full_end, kv_end, key_limit, block_row_ptr,
            kv_cache_ptr, kv_head, max_blocks_per_req, scale_log2,
            stride_cb, stride_ckv, stride_cs, stride_ch, offs_d, d_valid,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, FP32_IEEE, False,
        )
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, tl.maximum(full_end, tile_lo), tile_hi, kv_end, key_limit,
            block_row_ptr, kv_cache_ptr, kv_head, max_blocks_per_req, scale_log2,
            stride_cb, stride_ckv, stride_cs, stride_ch, offs_d, d_valid,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, FP32_IEEE, True,
        )

    if num_active == 1:  # NUM_SPLITS == 1, or the only split of a FUSE_REDUCE launch
        _store_rows(output_ptr, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], q_tok, head,
                    row_valid, d_valid, offs_d, stride_ot, stride_oh)
    else:
        ws_row = (split * num_tokens + q_tok) * num_heads + head
        tl.store(ws_acc_ptr + ws_row[:, None] * HEAD_PAD + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(ws_ml_ptr + ws_row * 2, m_i, mask=row_valid)
        tl.store(ws_ml_ptr + ws_row * 2 + 1, l_i, mask=row_valid)
        if FUSE_REDUCE:
            # The last of the num_active splits of these rows to finish combines every
            # active split's partial (no second launch). The barrier orders all of
            # this program's stores before the counter's release; the reducer's
            # acquire orders its loads after every other split's stores, and its
            # loads skip L1 (.cg), which is not coherent across SMs.
            tl.debug_barrier()
            counter = counters_ptr + tl.program_id(0)
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_active - 1:
                tl.store(counter, 0)  # ready for the next launch
                _reduce_rows(output_ptr, ws_acc_ptr, ws_ml_ptr, q_tok, head, row_valid,
                             d_valid, offs_d, num_tokens, num_heads, stride_ot, stride_oh,
                             num_active, HEAD_PAD, NUM_SPLITS)


@triton.jit
def _store_rows(output_ptr, out, q_tok, head, row_valid, d_valid, offs_d, stride_ot, stride_oh):
    """Write one program's normalised rows to the output (its dtype)."""
    tl.store(
        output_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(output_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


@triton.jit
def _reduce_rows(output_ptr, ws_acc_ptr, ws_ml_ptr, q_tok, head, row_valid, d_valid, offs_d,
                 num_tokens, num_heads, stride_ot, stride_oh, num_active,
                 HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for one program's rows,
    over the active splits 0 .. num_active - 1 in order (the same result whichever
    split reduces; the partials of splits past num_active are stale and never read)."""
    m_max = tl.full(q_tok.shape, float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (s * num_tokens + q_tok) * num_heads + head
        valid = row_valid & (tl.full(q_tok.shape, s, tl.int32) < num_active)
        m_s = tl.load(ws_ml_ptr + row * 2, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros(q_tok.shape, dtype=tl.float32)
    acc = tl.zeros([q_tok.shape[0], HEAD_PAD], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (s * num_tokens + q_tok) * num_heads + head
        valid = row_valid & (tl.full(q_tok.shape, s, tl.int32) < num_active)
        m_s = tl.load(ws_ml_ptr + row * 2, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ws_ml_ptr + row * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
        w = tl.exp2(m_s - m_max)  # 0 for splits that saw no key
        denom += w * l_s
        acc += w[:, None] * tl.load(ws_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :],
                                    mask=valid[:, None], other=0.0, cache_modifier=".cg")
    _store_rows(output_ptr, acc / tl.where(denom > 0.0, denom, 1.0)[:, None], q_tok, head,
                row_valid, d_valid, offs_d, stride_ot, stride_oh)


@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _reduce_splits_kernel(
    output_ptr,  # [num_tokens, num_heads, HEAD_SIZE]
    ws_acc_ptr,  # [NUM_SPLITS, num_tokens, num_heads, HEAD_PAD] fp32
    ws_ml_ptr,  # [NUM_SPLITS, num_tokens, num_heads, 2] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_tokens,
    num_reqs,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # padding row: zeroed by the attention kernel
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_valid = offs_s < NUM_SPLITS
    row = (offs_s.to(tl.int64) * num_tokens + token) * num_heads + head
    m = tl.load(ws_ml_ptr + row * 2, mask=s_valid, other=float("-inf"))
    l_s = tl.load(ws_ml_ptr + row * 2 + 1, mask=s_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # 0 for splits that saw no key
    denom = tl.sum(w * l_s, axis=0)
    acc = tl.load(
        ws_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], mask=s_valid[:, None], other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        output_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(output_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def unified_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks_per_req] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    workspace: torch.Tensor | None = None,  # fp32, >= split_workspace_numel(...) elements
    config: AttentionKernelConfig | None = None,
) -> torch.Tensor:
    """Causal paged attention over a flattened batch of prefills and decodes.

    Args:
        query: [T, num_heads, head_size] fp16/bf16/fp32, last dim contiguous.
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_size], the
            query's dtype; block_size a power of two; num_heads a multiple of
            num_kv_heads. Keys of this step must already be written.
        output: like `query`; every row is written (padding rows with zeros).
        query_start_loc: [R + 1] int32, non-decreasing, query_start_loc[R] <= T.
        seq_lens: [R] int32 (keys per request; 0 for padded requests).
        block_table: [>= R, max_blocks_per_req] int32, last dim contiguous.
        scale: softmax scale (usually head_size ** -0.5).
        max_query_len, max_seq_len: host upper bounds of the q_i and seq_lens;
            they only pick tiles and the split count (a captured graph passes its
            capture bounds; smaller real values stay correct).
        workspace: fp32 scratch for split-KV, >= split_workspace_numel(num_splits,
            T, num_heads, head_size) elements, zero-filled when allocated (its first
            split_counters_numel(num_heads) elements are the decode kernel's counters,
            which every launch leaves at zero); None allocates one when needed.
            Under CUDA-graph capture pass a preallocated buffer (see
            max_split_workspace_numel, which covers every automatic choice).
        config: tile override (benchmarks); None chooses with `select_config`.

    Returns:
        `output`.

    Raises:
        ValueError: dtypes, shapes, strides, devices or a workspace that do not
            fit (the message names the tensor and the numbers). No host sync.
    """
    num_tokens, num_heads, head_size = check_inputs(
        query, kv_cache, output, query_start_loc, seq_lens, block_table
    )
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0:
        return output
    if num_reqs == 0:
        return output.zero_()
    cfg = choose_config(query, kv_cache, num_reqs, max_query_len, max_seq_len, config)
    counters, ws_acc, ws_ml = split_workspace(workspace, cfg.num_splits, output, head_size)
    fuse_reduce = _launch_attention(query, kv_cache, output, ws_acc, ws_ml, counters,
                                    query_start_loc, seq_lens, block_table, scale, cfg)
    if cfg.num_splits > 1 and not fuse_reduce:
        _launch_reduce(output, ws_acc, ws_ml, query_start_loc, num_reqs, cfg.num_splits,
                       head_size)
    return output


def _launch_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, ws_acc: torch.Tensor,
    ws_ml: torch.Tensor, counters: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, cfg: AttentionKernelConfig,
) -> bool:
    """Launch `_unified_attention_kernel` with `cfg` over checked inputs; returns whether
    the launch combines its splits itself (FUSE_REDUCE), else the caller reduces."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs, num_kv_heads = seq_lens.shape[0], kv_cache.shape[3]
    grid = launch_grid(cfg, num_tokens, num_reqs, num_heads, num_kv_heads)
    # Decode launches (the CUDA graphs') of 2..FUSED_REDUCE_MAX_SPLITS splits reduce in
    # their last split; others launch _reduce_splits_kernel, as does a decode grid with
    # more programs than counters (only a tile override can make one).
    fuse_reduce = fuses_reduce(cfg) and grid[0] <= split_counters_numel(num_heads)
    constexprs = kernel_constexprs(cfg, num_heads // num_kv_heads, head_size, kv_cache.shape[2],
                                   query.dtype, fuse_reduce)
    _unified_attention_kernel[grid](
        query, kv_cache, output, ws_acc, ws_ml, counters, query_start_loc, seq_lens, block_table,
        scale * _LOG2E, num_tokens, num_reqs, num_heads, num_kv_heads, block_table.shape[1],
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return fuse_reduce


def _launch_reduce(
    output: torch.Tensor, ws_acc: torch.Tensor, ws_ml: torch.Tensor,
    query_start_loc: torch.Tensor, num_reqs: int, splits: int, head_size: int,
) -> None:
    """Launch `_reduce_splits_kernel`: one program per (token, head) combines the splits."""
    num_tokens, num_heads = output.shape[0], output.shape[1]
    hp = head_pad(head_size)
    _reduce_splits_kernel[(num_tokens, num_heads)](
        output, ws_acc, ws_ml, query_start_loc, num_tokens, num_reqs, num_heads,
        output.stride(0), output.stride(1),
        HEAD_SIZE=head_size,
        HEAD_PAD=hp,
        NUM_SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        num_warps=4 if splits * hp >= 2048 else 2,
    )


def unified_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks_per_req] int32
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference of `unified_attention` (host loop over requests).

    The math runs in float64, so no TF32 setting of torch's matmuls can blur it.

    Returns:
        [num_tokens, num_heads, head_size] in query's dtype; rows of padding
        tokens and rows with an empty causal range are zeros.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64, device=query.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_table[i, positions // block_size].long()
        k = kv_cache[blocks, 0, positions % block_size].double().repeat_interleave(group, dim=1)
        v = kv_cache[blocks, 1, positions % block_size].double().repeat_interleave(group, dim=1)
        q = query[starts[i] : starts[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = seq_len - q_len + torch.arange(q_len, device=query.device)
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> 0
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype)
