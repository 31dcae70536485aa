"""Triton kernels of the async spec-decode step's device rows (`AsyncSpecState`).

A device row's step, in tensor ops (the torch path, kept for the CPU and as the
reference), launches ~30 small kernels to write the row's inputs and ~70 to verify,
append and propose: on the H100 the step was host-bound on their launches (issue
50: 4.3 ms a spec step against a 0.65 ms plain one, verify graphs replayed). Here
each half is one launch, one program per device row::

    _feed_rows_kernel     rows [6, >= D] (slot, host start, batch row, k', first flat
                          index, first logits row) + hist, hist_len, drafts,
                          num_drafts, block table
                          -> input_ids / positions / slot_mapping of the row's
                             1 + k' tokens, seq_lens[row] += true - host start,
                             nd[d] = min(num_drafts[slot], k')
    _advance_rows_kernel  ACCEPT (greedy rows): target argmax [T] + drafts[slot]
                          -> emitted [D, W] (a accepted drafts, the target's token,
                             -1), accepted [D]
                          else: emitted [D, W] + counts [D] given (the sampler's or
                             the rejection sampler's tokens)
                          then hist[slot, len:len + count] = tokens, len += count,
                          a barrier, and the n-gram proposal on the new history:
                          drafts[slot], num_drafts[slot]

The proposal scans ends e <= len - 2 in blocks of BLOCK_L, counting each end's
trailing matches with the row's last prompt_lookup_max tokens (the same rule as
`DeviceNgramProposer`, the torch reference, and `NgramProposer`): the longest
suffix n >= prompt_lookup_min at its earliest occurrence, and the up to k tokens
after it. One program reads its row's history once per suffix position
(prompt_lookup_max x len int32 loads), nothing else.

References: `AsyncSpecState._prepare_torch` (feed), `emit_tokens` +
`AsyncSpecState._append_torch` + `DeviceNgramProposer.propose` (advance);
tests/v1/spec_decode/test_async_spec_ops.py compares them under TRITON_INTERPRET=1
on the CPU and on CUDA. Integer arguments that vary per step are
`do_not_specialize` and the per-row fields arrive 16-byte aligned, so each kernel
(and each mode of the second) compiles once, in the profile run (`warm_up`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import check_same_device
from vllm.model_executor.layers.ops.launch import CompiledLaunches

# Row fields of `feed_rows`' `rows` [6, D] int64.
ROW_FIELDS = ("slot", "host_start", "batch_row", "num_slots", "first_flat", "first_logit")


@triton.jit(do_not_specialize=["row_stride", "block_table_stride", "block_size"])
def _feed_rows_kernel(
    rows_ptr,  # [6, >= D] int64 (ROW_FIELDS)
    row_stride,
    hist_ptr,  # [S, L] int32
    hist_stride,
    hist_len_ptr,  # [S] int64
    drafts_ptr,  # [S, K] int64
    drafts_stride,
    num_drafts_ptr,  # [S] int64
    block_table_ptr,  # [R, B] int32
    block_table_stride,
    block_size,
    input_ids_ptr,  # [N] int64
    positions_ptr,  # [N] int64
    slot_mapping_ptr,  # [N] int64
    seq_lens_ptr,  # [R] int32
    nd_ptr,  # [D] int64, out
    BLOCK_Q: tl.constexpr,  # >= K + 1
):
    d = tl.program_id(0)
    slot = tl.load(rows_ptr + d)
    host_start = tl.load(rows_ptr + row_stride + d)
    row = tl.load(rows_ptr + 2 * row_stride + d)
    kp = tl.load(rows_ptr + 3 * row_stride + d)
    first = tl.load(rows_ptr + 4 * row_stride + d)
    true_start = tl.load(hist_len_ptr + slot) - 1
    nd = tl.minimum(tl.load(num_drafts_ptr + slot), kp)
    j = tl.arange(0, BLOCK_Q)
    live = j <= kp
    ok = j <= nd
    pos = true_start + j
    last = tl.load(hist_ptr + slot * hist_stride + true_start).to(tl.int64)
    draft = tl.load(drafts_ptr + slot * drafts_stride + (j - 1), mask=ok & (j >= 1), other=0)
    ids = tl.where(j == 0, last, draft)
    block = tl.load(block_table_ptr + row * block_table_stride + pos // block_size,
                    mask=live & ok, other=0).to(tl.int64)
    kv = tl.where(ok, block * block_size + pos % block_size, -1)
    tl.store(input_ids_ptr + first + j, ids, mask=live)
    tl.store(positions_ptr + first + j, pos, mask=live)
    tl.store(slot_mapping_ptr + first + j, kv, mask=live)
    seq = tl.load(seq_lens_ptr + row)
    tl.store(seq_lens_ptr + row, seq + (true_start - host_start).to(tl.int32))
    tl.store(nd_ptr + d, nd)


@triton.jit(do_not_specialize=["width", "max_len"])
def _advance_rows_kernel(
    slots_ptr,  # [D] int64
    target_ptr,  # ACCEPT: [T] int64, the argmax of each verified position
    starts_ptr,  # ACCEPT: [D] int64, row d's first position in target
    nd_ptr,  # ACCEPT: [D] int64, drafts verified
    emitted_ptr,  # [D, width] int64: ACCEPT out, else in
    counts_ptr,  # [D] int64: ACCEPT out (accepted), else in (tokens to append)
    width,
    hist_ptr,  # [S, L] int32
    hist_stride,
    hist_len_ptr,  # [S] int64
    drafts_ptr,  # [S, K] int64
    drafts_stride,
    num_drafts_ptr,  # [S] int64
    max_len,  # L
    K: tl.constexpr,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    ACCEPT: tl.constexpr,
    BLOCK_W: tl.constexpr,  # >= width, >= K
    BLOCK_L: tl.constexpr,
):
    d = tl.program_id(0)
    slot = tl.load(slots_ptr + d)
    hist_row = hist_ptr + slot * hist_stride
    w = tl.arange(0, BLOCK_W)
    if ACCEPT:
        start = tl.load(starts_ptr + d)
        nd = tl.load(nd_ptr + d)
        drafts = tl.load(drafts_ptr + slot * drafts_stride + w, mask=w < nd, other=-1)
        target = tl.load(target_ptr + start + tl.minimum(w, nd))
        match = (drafts == target) & (w < nd)
        accepted = tl.min(tl.where(match, BLOCK_W, w), axis=0)  # the first mismatch
        final = tl.sum(tl.where(w == accepted, target, 0), axis=0)
        tokens = tl.where(w < accepted, drafts, tl.where(w == accepted, final, -1))
        tl.store(emitted_ptr + d * width + w, tokens, mask=w < width)
        tl.store(counts_ptr + d, accepted.to(tl.int64))
        count = accepted.to(tl.int64) + 1
    else:
        count = tl.load(counts_ptr + d)
        tokens = tl.load(emitted_ptr + d * width + w, mask=w < count, other=-1)
    # Append the step's tokens to the row's history.
    n = tl.load(hist_len_ptr + slot)
    tl.store(hist_row + n + w, tokens.to(tl.int32), mask=(w < count) & (n + w < max_len))
    n = tl.minimum(n + count, max_len)
    tl.store(hist_len_ptr + slot, n)
    tl.debug_barrier()  # the proposal below reads what the block's threads just stored
    # Propose: ends e <= n - 2 whose trailing matches with the suffix are the most.
    best = (n * 0).to(tl.int32)
    first = n * 0
    for lo in range(0, n - 1, BLOCK_L):
        e = lo + tl.arange(0, BLOCK_L)
        alive = e <= n - 2
        trailing = tl.zeros([BLOCK_L], dtype=tl.int32)
        for i in tl.static_range(MAX_N):
            s = tl.load(hist_row + tl.maximum(n - 1 - i, 0))
            s = tl.where(n - 1 - i >= 0, s, -2)  # before the row: matches nothing
            tok = tl.load(hist_row + (e - i), mask=alive & (e - i >= 0), other=-1)
            alive = alive & (tok == s)
            trailing += alive.to(tl.int32)
        block_best = tl.max(trailing, axis=0)
        block_first = tl.min(tl.where(trailing == block_best, e, max_len), axis=0)
        better = block_best > best
        first = tl.where(better, block_first, first)
        best = tl.where(better, block_best, best)
    index = first + 1 + w
    end = tl.where(best >= MIN_N, n, 0)  # no suffix found: no draft
    valid = (index < end) & (w < K)
    proposal = tl.load(hist_row + index, mask=valid, other=0).to(tl.int64)
    tl.store(drafts_ptr + slot * drafts_stride + w, proposal, mask=w < K)
    tl.store(num_drafts_ptr + slot, tl.sum(valid.to(tl.int64), axis=0))


class DeviceRowState:
    """The per-slot device state the kernels read and write (`AsyncSpecState`'s fields).

    Args:
        hist: [S, L] int32 token histories.
        hist_len: [S] int64 their lengths.
        drafts: [S, K] int64 the next drafts (0 past num_drafts).
        num_drafts: [S] int64.
        min_n / max_n: prompt_lookup_min / max.

    Raises:
        ValueError: dtypes, shapes or devices differ from the above.
    """

    def __init__(self, hist: torch.Tensor, hist_len: torch.Tensor, drafts: torch.Tensor,
                 num_drafts: torch.Tensor, min_n: int, max_n: int) -> None:
        check_same_device("DeviceRowState", hist=hist, hist_len=hist_len, drafts=drafts,
                          num_drafts=num_drafts)
        s = hist.shape[0]
        want = {"hist": (hist, torch.int32, 2), "hist_len": (hist_len, torch.int64, 1),
                "drafts": (drafts, torch.int64, 2), "num_drafts": (num_drafts, torch.int64, 1)}
        for name, (t, dtype, dim) in want.items():
            if t.dtype != dtype or t.dim() != dim or t.shape[0] != s or t.stride(-1) != 1:
                raise ValueError(f"DeviceRowState: {name} must be {dim}-d {dtype} with "
                                 f"{s} rows, last dim contiguous; got {t.dtype} "
                                 f"{tuple(t.shape)} strides {t.stride()}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"DeviceRowState: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.hist, self.hist_len, self.drafts, self.num_drafts = hist, hist_len, drafts, num_drafts
        self.k = drafts.shape[1]
        self.min_n, self.max_n = min_n, max_n
        self.device = hist.device

    def feed_rows(self, rows: torch.Tensor, num_rows: int, block_table: torch.Tensor,
                  block_size: int, input_ids: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Write D device rows' inputs (see the module docstring); one launch.

        Args:
            rows: [>= 5, >= D] int64 (ROW_FIELDS; the sixth is not read), last dim
                contiguous.
            num_rows: D >= 1.
            block_table: [R, B] int32, last dim contiguous.
            input_ids, positions, slot_mapping: [N] int64 step buffers.
            seq_lens: [R] int32.

        Returns:
            nd [D] int64: the drafts each row verifies (<= its k').
        """
        if (rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[0] < 5
                or rows.shape[1] < num_rows or num_rows < 1 or rows.stride(1) != 1):
            raise ValueError(f"feed_rows: rows must be [>= 5, >= {num_rows}] int64 with a "
                             f"contiguous last dim, got {rows.dtype} {tuple(rows.shape)}")
        if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("feed_rows: block_table and seq_lens must be int32")
        for name, t in (("input_ids", input_ids), ("positions", positions),
                        ("slot_mapping", slot_mapping)):
            if t.dtype != torch.int64:
                raise ValueError(f"feed_rows: {name} must be int64, got {t.dtype}")
        nd = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        q = triton.next_power_of_2(self.k + 1)
        args = (rows, rows.stride(0), self.hist, self.hist.stride(0), self.hist_len, self.drafts,
                self.drafts.stride(0), self.num_drafts, block_table, block_table.stride(0),
                block_size, input_ids, positions, slot_mapping, seq_lens, nd, q)
        _FEED(_key(args), (num_rows,), args, self.device, num_warps=1)
        return nd

    def accept(self, slots: torch.Tensor, target: torch.Tensor, starts: torch.Tensor,
               nd: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy verification of D rows, then append and propose (one launch).

        Args:
            slots: [D] int64.
            target: [T] int64, each verified position's argmax (row d's at
                starts[d] .. starts[d] + nd[d]).
            starts, nd: [D] int64.
            width: W >= max(nd) + 1, the emitted rows' width.

        Returns:
            (emitted [D, W] int64: accepted drafts, the target's token, then -1;
             accepted [D] int64)
        """
        num_rows = slots.shape[0]
        emitted = torch.empty(num_rows, width, dtype=torch.int64, device=self.device)
        accepted = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        self._advance(slots, emitted, accepted, True, target, starts, nd)
        return emitted, accepted

    def append(self, slots: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """hist[slot] += tokens[d, :counts[d]], then propose (one launch).

        Args:
            slots: [D] int64.
            tokens: [D, W] int64, contiguous.
            counts: [D] int64 in [0, W].
        """
        self._advance(slots, tokens, counts, False, slots, slots, slots)

    def warm_up(self) -> None:
        """Compile every kernel variant a step launches (the profile run calls this, so no
        request pays a Triton compile), on scratch rows; leaves every slot empty."""
        slots = torch.arange(self.hist.shape[0], device=self.device)
        zeros = torch.zeros(len(slots), 1, dtype=torch.int64, device=self.device)
        self.append(slots, zeros, zeros[:, 0].contiguous())  # appends nothing, proposes
        nd = torch.zeros_like(slots)
        self.accept(slots[:1], nd[:1], nd[:1], nd[:1], 1)  # appends one token to slot 0
        # Separate scratch tensors: 16-byte aligned like the step buffers (Triton
        # specialises on the alignment).
        ids, positions, slot_mapping = (torch.zeros(1, dtype=torch.int64, device=self.device)
                                        for _ in range(3))
        self.feed_rows(torch.zeros(6, 2, dtype=torch.int64, device=self.device), 1,
                       torch.zeros(1, 1, dtype=torch.int32, device=self.device), 16,
                       ids, positions, slot_mapping,
                       torch.zeros(1, dtype=torch.int32, device=self.device))
        self.hist_len.zero_()
        self.num_drafts.zero_()

    def _advance(self, slots, emitted, counts, accept, target, starts, nd) -> None:
        num_rows, width = emitted.shape
        for name, t in (("slots", slots), ("emitted", emitted), ("counts", counts),
                        ("target", target), ("starts", starts), ("nd", nd)):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"advance: {name} must be contiguous int64, got {t.dtype}")
        if slots.shape != (num_rows,) or counts.shape != (num_rows,):
            raise ValueError(f"advance: slots {tuple(slots.shape)} and counts "
                             f"{tuple(counts.shape)} must be [{num_rows}]")
        if num_rows == 0:
            return
        block_w = triton.next_power_of_2(max(width, self.k))
        args = (slots, target, starts, nd, emitted, counts, width, self.hist,
                self.hist.stride(0), self.hist_len, self.drafts, self.drafts.stride(0),
                self.num_drafts, self.hist.shape[1], self.k, self.min_n, self.max_n, accept,
                block_w, _BLOCK_L)
        _ADVANCE(_key(args), (num_rows,), args, self.device, num_warps=4)


_BLOCK_L = 512  # history positions a proposal step compares at once


def _key(args: tuple) -> tuple:
    """What Triton specialises on in `args`: tensors' dtype and 16-byte alignment, the
    integers (the `do_not_specialize` ones vary per step but do not specialise; the
    others are fixed per engine: strides, constexprs)."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a
                 for a in args)


_FEED = CompiledLaunches(_feed_rows_kernel)
_ADVANCE = CompiledLaunches(_advance_rows_kernel)
