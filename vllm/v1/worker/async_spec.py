"""Async scheduling with n-gram speculative decoding: the runner's device half.

The scheduler schedules a decoding request that takes drafts for 1 + k' tokens
before the last step's acceptance is known (`SpecDecodeScheduling`, placeholders
for the drafts and optimistic `num_computed_tokens`). Here the step's inputs of
those rows ("device rows") come from the device, where the last step left them::

    step N    forward -> verify (emit_tokens, no read) -> hist[slot] += a + 1 tokens
              -> DeviceNgramProposer(hist) -> drafts[slot], num_drafts[slot]
              -> emitted [D, k + 1] to the host (copy stream + event)
    step N+1  true start = hist_len - 1 (the host's start is optimistic by k' - a):
              input ids  = last token, drafts[slot][:k'] (id 0 past num_drafts)
              positions  = true start + j
              slots      = from the device block table (-1 past num_drafts: no KV)
              seq_lens  -= optimistic - true start
    engine    get_output(N): the a + 1 tokens join the host's request state

The history is per request ("slot", held while the request is in the batch) and
is uploaded from the host whenever a request enters the batch (new, resumed, or
back after a step without it), when the host's state is complete. Requests that
take no drafts (penalties, logprobs, a grammar) run as plain rows: sampler,
placeholders (`AsyncStepState`); their sampled tokens join the history too.

Where Triton runs (CUDA; the CPU under TRITON_INTERPRET=1), the device rows' part of
a step is two launches (`DeviceRowState`, async_spec_ops.py): the inputs, then the
greedy verification + append + proposal; the tensor ops here (`_prepare_torch`,
`_emit`, `_append_torch`, `_propose_torch`) are the CPU's path and the reference.
~110 small torch ops a step made the H100's async spec step host-bound (issue 50).
docs/design.md, "Speculative decoding and async scheduling".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm.model_executor.layers.ops import triton_launches_on
from vllm.sampling_params import SamplingType
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.sample.metadata import build_sampling_metadata
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, emit_tokens
from vllm.v1.sample.sampler import SamplerOutput, argmax_rows
from vllm.v1.worker.input_batch import InputBatch
from vllm.v1.worker.ngram_device import DeviceNgramProposer
from vllm.v1.worker.spec_decode import SpecDecoder
from vllm.v1.worker.step_buffers import StepBuffers


class AsyncSpecState:
    """Token histories, drafts and the device rows' inputs and outputs.

    Args:
        proposer: the batched device n-gram proposer (k drafts).
        max_num_reqs: most requests in the batch (the slots).
        max_model_len: most tokens per request (the history's width).
        block_size: tokens per KV block.
        vocab_size: the logits' width.
        device: the model's device.
    """

    def __init__(self, proposer: DeviceNgramProposer, max_num_reqs: int, max_model_len: int,
                 block_size: int, vocab_size: int, device: torch.device) -> None:
        self.proposer, self.k = proposer, proposer.k
        self.max_model_len, self.block_size = max_model_len, block_size
        self.vocab_size, self.device = vocab_size, device
        self.cuda = device.type == "cuda"
        self.hist = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32, device=device)
        self.hist_len = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(max_num_reqs, self.k, dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # Pinned rows the emitted tokens and draft counts land in, used in turn: step N's
        # row is read by its get_output(), which the engine calls before step N + 2.
        self._host_tokens = torch.zeros(2, max_num_reqs * (self.k + 1), dtype=torch.int64,
                                        pin_memory=self.cuda)
        self._host_nd = torch.zeros(2, max_num_reqs, dtype=torch.int64, pin_memory=self.cuda)
        self._turn = 0
        # This step's device rows: (batch rows, slots, k' each), set by prepare().
        self._rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._emitted: torch.Tensor | None = None  # [D, K + 1] of the step
        # One Triton launch each for the rows' inputs and for verify + append + propose
        # (async_spec_ops.py) where Triton runs; the tensor ops below elsewhere.
        self.ops = None
        if triton_launches_on(device):
            from vllm.v1.worker.async_spec_ops import DeviceRowState

            self.ops = DeviceRowState(self.hist, self.hist_len, self.drafts, self.num_drafts,
                                      proposer.min_n, proposer.max_n)

    @classmethod
    def of(cls, spec_decoder: SpecDecoder | None, async_scheduling: bool, max_num_reqs: int,
           max_model_len: int, block_size: int, vocab_size: int, device: torch.device
           ) -> AsyncSpecState | None:
        """The runner's async speculative state: async scheduling with n-gram drafts
        (a draft model keeps the synchronous path: the config turns async off); else None."""
        if spec_decoder is None or not async_scheduling or spec_decoder.draft is not None:
            return None
        ngram = spec_decoder.proposer
        return cls(DeviceNgramProposer(ngram.k, ngram.min_n, ngram.max_n), max_num_reqs,
                   max_model_len, block_size, vocab_size, device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        if self.cuda:  # pinned by the caching host allocator: safe to drop after the copy
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def enter(self, batch: InputBatch) -> None:
        """After the runner's state update: slots for requests that entered the batch
        (their host tokens uploaded), freed for those that left it."""
        present = set(batch.req_ids)
        for req_id in [r for r in self.slot_of if r not in present]:
            self._free.append(self.slot_of.pop(req_id))
        for row, req_id in enumerate(batch.req_ids):
            if req_id in self.slot_of:
                continue
            slot = self.slot_of[req_id] = self._free.pop()
            n = int(batch.num_tokens[row])
            self.hist[slot, :n] = self._to_device(batch.token_ids[row, :n])
            self.hist_len[slot] = n
            self.num_drafts[slot] = 0

    def prepare(self, batch: InputBatch, spec: dict[str, list[int]], num_sched: np.ndarray,
                buf: StepBuffers) -> None:
        """Rewrite the device rows' inputs in the step buffers from the device state
        (after `_prepare_inputs`, before the forward; see the module docstring). First
        the slots follow the batch (`enter`)."""
        self.enter(batch)
        rows = np.array([r for r, req in enumerate(batch.req_ids) if req in spec], dtype=np.int64)
        cu = np.cumsum(num_sched)
        if not len(rows):
            self._rows = None
            return
        slots = np.array([self.slot_of[batch.req_ids[r]] for r in rows], dtype=np.int64)
        lens = num_sched[rows].astype(np.int64)  # 1 + k'
        self._rows = (rows, slots, lens - 1)
        t, d = int(lens.sum()), len(rows)
        first_logit = np.cumsum(lens) - lens
        flat = np.repeat(cu[rows] - lens, lens) + np.arange(t) - np.repeat(first_logit, lens)
        host_start = batch.num_computed_tokens[rows].astype(np.int64)
        # One upload for the step: [6, p] per device row (ROW_FIELDS), then per device-row
        # token; p = d rounded up to even, so every field starts 16-byte aligned (Triton
        # specialises on a pointer's alignment: one compiled variant for every d).
        fields = np.zeros((6, d + (d & 1)), dtype=np.int64)
        fields[:, :d] = (slots, host_start, rows, lens - 1, cu[rows] - lens, first_logit)
        packed = self._to_device(np.concatenate([fields.ravel(), flat]))
        per_row = packed[: fields.size].view(fields.shape)
        self._slot_d, self._first_d = per_row[0, :d], per_row[5, :d]
        self._flat_t = packed[fields.size :]
        if self.ops is not None:
            self._nd = self.ops.feed_rows(per_row, d, batch.block_table.device_tensor,
                                          self.block_size, buf.input_ids, buf.positions,
                                          buf.slot_mapping, buf.seq_lens)
            if not self.cuda:  # the kernels interpreted on the CPU (tests): the host twin
                buf.seq_lens_cpu[: batch.num_reqs].copy_(buf.seq_lens[: batch.num_reqs])
        else:
            self._nd = self._prepare_torch(per_row[:, :d], lens, batch, buf)

    def _prepare_torch(self, per_row: torch.Tensor, lens: np.ndarray, batch: InputBatch,
                       buf: StepBuffers) -> torch.Tensor:
        """`prepare`'s tensor ops (the CPU's path; `_feed_rows_kernel`'s reference).
        Returns nd [D] int64, the drafts each row verifies."""
        slot_d, start_d, row_d, kp_d, first_flat = per_row[:5]
        d = len(lens)
        flat_t = self._flat_t
        drow_t = self._to_device(np.repeat(np.arange(d), lens))
        j_t = flat_t - first_flat[drow_t]
        true_start = self.hist_len[slot_d] - 1
        nd = torch.minimum(self.num_drafts[slot_d], kp_d)
        slot_t = slot_d[drow_t]
        pos = true_start[drow_t] + j_t
        last = self.hist[slot_d, true_start][drow_t]
        draft = self.drafts[slot_t, (j_t - 1).clamp(min=0)]
        ok = j_t <= nd[drow_t]
        ids = torch.where(j_t == 0, last, torch.where(ok, draft, 0))
        bt = batch.block_table.device_tensor
        block = bt[row_d[drow_t], pos // self.block_size].to(torch.int64)
        kv_slot = torch.where(ok, block * self.block_size + pos % self.block_size, -1)
        # index_copy_ / index_add_: never a host sync (as `AsyncStepState.feed`)
        buf.input_ids.index_copy_(0, flat_t, ids.to(buf.input_ids.dtype))
        buf.positions.index_copy_(0, flat_t, pos.to(buf.positions.dtype))
        buf.slot_mapping.index_copy_(0, flat_t, kv_slot.to(buf.slot_mapping.dtype))
        delta = (true_start - start_d).to(buf.seq_lens.dtype)  # <= 0
        buf.seq_lens.index_add_(0, row_d, delta)
        if not self.cuda:  # the CPU attention reads the host twin (the same memory kind)
            buf.seq_lens_cpu.index_add_(0, row_d, delta)
        return nd

    def verify(self, model: torch.nn.Module, hidden: torch.Tensor, batch: InputBatch,
               sampling_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The device rows' verification, on the device: their emitted tokens join the
        histories and the next drafts are proposed. Returns (the sampling rows left to
        the sampler, [n] bool: which sampling rows were device rows)."""
        self._emitted = None
        if self._rows is None:
            return sampling_rows, np.zeros(len(sampling_rows), dtype=bool)
        rows, slots, kp = self._rows
        is_dev = np.isin(sampling_rows, rows)
        logits = model.compute_logits(hidden[self._flat_t])  # the device rows' tokens, in order
        kmax = int(kp.max())
        starts, slot_d, nd = self._first_d, self._slot_d, self._nd
        states = [batch.states[r] for r in rows]
        if self.ops is not None and all(
                s.sampling_params.sampling_type == SamplingType.GREEDY for s in states):
            # Greedy rows: the argmax, then one launch verifies, appends and proposes.
            target = argmax_rows(logits)
            del logits
            self._emitted, _ = self.ops.accept(slot_d, target, starts, nd, kmax + 1)
        else:
            emitted, accepted = self._emit(logits, states, kp, starts, nd, kmax)
            self._advance(slot_d, emitted, accepted + 1,
                          batch.num_computed_tokens[rows] + kp + 2)
            self._emitted = emitted
        return sampling_rows[~is_dev], is_dev

    def _emit(self, logits: torch.Tensor, states: list, kp: np.ndarray, starts: torch.Tensor,
              nd: torch.Tensor, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`emit_tokens` over the device rows (any sampling): (emitted [D, kmax + 1],
        accepted [D]); the logits are freed before the proposal (their peaks never add)."""
        pos = torch.arange(kmax + 1, device=self.device).unsqueeze(0)
        flat = starts.unsqueeze(1) + torch.minimum(pos, nd.unsqueeze(1))
        valid = pos[:, :kmax] < nd.unsqueeze(1)
        drafts = torch.where(valid, self.drafts[self._slot_d, :kmax], 0)
        params = [s.sampling_params for s, k in zip(states, kp, strict=True) for _ in range(k + 1)]
        md = build_sampling_metadata(params, [[0]] * len(params), [[] for _ in params], {},
                                     self.vocab_size, self.device)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        return emit_tokens(logits, md, generators, starts, flat, valid, drafts)

    def after_sample(self, batch: InputBatch, rows: np.ndarray,
                     sampler_output: SamplerOutput | None) -> None:
        """The sampler's tokens (plain rows) join their histories; drafts follow."""
        if sampler_output is None or not len(rows):
            return
        slot_d = self._to_device(np.array([self.slot_of[batch.req_ids[r]] for r in rows]))
        tokens = sampler_output.sampled_token_ids.to(torch.int64).unsqueeze(1).contiguous()
        # The histories end by the optimistic end of this step (after its increment).
        self._advance(slot_d, tokens, torch.ones_like(slot_d), batch.num_computed_tokens[rows] + 1)

    def _advance(self, slot_d: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
                 ends: np.ndarray | None) -> None:
        """hist[slot, len + j] = tokens[:, j] for j < count; len += count; then the next
        drafts of those slots. `ends`: host upper bounds of the new lengths (the torch
        path's scan width), None: the full width."""
        if self.ops is not None:
            self.ops.append(slot_d, tokens, count)
            return
        self._append_torch(slot_d, tokens, count)
        self._propose_torch(slot_d, ends)

    def _append_torch(self, slot_d: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor
                      ) -> None:
        """hist[slot, len + j] = tokens[:, j] for j < count; len += count (no host sync;
        the reference of `_advance_rows_kernel`'s append)."""
        j = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0)
        idx = (self.hist_len[slot_d].unsqueeze(1) + j).clamp(max=self.max_model_len - 1)
        flat = (slot_d.unsqueeze(1) * self.max_model_len + idx).flatten()
        hist = self.hist.view(-1)
        keep = (j < count.unsqueeze(1)).flatten()
        hist.index_copy_(0, flat, torch.where(keep, tokens.flatten().to(hist.dtype),
                                              hist[flat]))
        self.hist_len.index_copy_(
            0, slot_d, (self.hist_len[slot_d] + count).clamp(max=self.max_model_len))

    def dummy_propose(self) -> None:
        """The proposal over every slot at full width (the profile run counts its peak:
        [max_num_reqs, max_model_len, prompt_lookup_max] temporaries on the torch path;
        none with the kernels, which are compiled here instead of at the first request)."""
        if self.ops is not None:
            self.ops.warm_up()
            return
        self._propose_torch(torch.arange(self.hist.shape[0], device=self.device), None)

    def _propose_torch(self, slot_d: torch.Tensor, ends: np.ndarray | None) -> None:
        """Drafts of `slot_d` from their histories, read up to a width covering `ends`
        (host upper bounds of their lengths; None: the full width): a step scans what
        its rows hold, not max_model_len (rounded up to 256: few distinct shapes)."""
        width = self.max_model_len
        if ends is not None:
            width = min(width, -(-int(np.max(ends)) // 256) * 256)
        drafts, counts = self.proposer.propose(self.hist[slot_d, :width],
                                               self.hist_len[slot_d])
        self.drafts.index_copy_(0, slot_d, drafts.clamp(min=0))
        self.num_drafts.index_copy_(0, slot_d, counts)

    def output(self, inner: ModelRunnerOutput | AsyncModelRunnerOutput,
               output: ModelRunnerOutput, batch: InputBatch, rows: np.ndarray,
               sampler_output: SamplerOutput | None
               ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's end: the sampler's tokens (`rows`) join their histories; the
        output is wrapped so that `get_output()` also brings the device rows' tokens
        home (copied on the side stream now, read then)."""
        self.after_sample(batch, rows, sampler_output)
        emitted = self._emitted
        if emitted is None:
            return inner
        rows, _, _ = self._rows
        output.num_draft_tokens = [0] * len(output.req_ids)
        states = [batch.states[r] for r in rows]
        tensors = [emitted, self._nd]
        host: list[torch.Tensor]
        event = None
        if self.copy_stream is None:
            host = tensors
        else:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(ready)
            self._turn ^= 1
            d, w = emitted.shape
            host = [self._host_tokens[self._turn, : d * w].view(d, w),
                    self._host_nd[self._turn, :d]]
            with torch.cuda.stream(self.copy_stream):
                for dst, src in zip(host, tensors, strict=True):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)

        def fill(out: ModelRunnerOutput, keep: list[torch.Tensor] = tensors) -> None:
            # `keep`: the device tensors stay alive until their copy ended (the side
            # stream reads them; freed earlier, the allocator could hand them out).
            if event is not None:
                event.synchronize()
            for row, state, tokens, nd in zip(rows.tolist(), states, host[0].tolist(),
                                              host[1].tolist(), strict=True):
                tokens = [t for t in tokens if t != PLACEHOLDER_TOKEN_ID]
                out.sampled_token_ids[row] = tokens
                out.num_draft_tokens[row] = nd
                state.output_token_ids.extend(tokens)
                at = batch.req_id_to_index.get(state.req_id)
                if at is not None and batch.states[at] is state:
                    for tok in tokens:
                        if batch.num_tokens[at] < self.max_model_len:
                            batch.append_token(at, tok)

        return AsyncSpecOutput(inner, fill)


class AsyncSpecOutput(AsyncModelRunnerOutput):
    """A step's output whose device rows' tokens are on their way to the host."""

    def __init__(self, inner: ModelRunnerOutput | AsyncModelRunnerOutput,
                 fill: Callable[[ModelRunnerOutput], None]) -> None:
        self._inner = inner
        self._fill: Callable[[ModelRunnerOutput], None] | None = fill
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        inner = self._inner
        out = inner.get_output() if isinstance(inner, AsyncModelRunnerOutput) else inner
        if self._fill is not None:
            self._fill(out)
            self._fill = None
        return out
