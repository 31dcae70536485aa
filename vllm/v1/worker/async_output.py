"""Async scheduling's half in the runner: sampled ids stay on the device, the host gets them later.

    step N   forward -> sample -> sampled [n] int64 (device) --+-- copy stream: D2H + event
                                                               |
    step N+1 prepare inputs: input_ids[flat] = sampled[i] <----+   (a device-side copy: the
             host has a placeholder (-1) where the token goes)      host never waits for it)
    engine   update_from_output(N) <- AsyncRunnerOutput.get_output(): event.synchronize(),
             the ids replace the placeholders in the runner's host state

The engine core calls `get_output()` of step N only after it launched step
N+1 (v1/engine/core.py), so the device runs N+1 while the host turns step N's
ids into Python lists, checks stop conditions and detokenizes. vLLM does the
same in its `AsyncGPUModelRunnerOutput` (a copy stream and an event) and by
writing the previous step's sampled ids into `input_ids` on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.v1.outputs import AsyncModelRunnerOutput, LogprobsLists, ModelRunnerOutput
from vllm.v1.sample.logprobs import LogprobsTensors

if TYPE_CHECKING:
    from vllm.v1.sample.sampler import SamplerOutput
    from vllm.v1.worker.input_batch import CachedRequestState, InputBatch

# Stands for a sampled token whose id is not on the host yet. Never a valid
# id: if it ever reached the embedding, the lookup would fail loudly.
PLACEHOLDER_TOKEN_ID = -1


class AsyncRunnerOutput(AsyncModelRunnerOutput):
    """One step's output whose sampled ids (and logprobs) are being copied to the host.

    Args:
        output: the step's output with empty `sampled_token_ids` rows; filled
            in by `get_output()`.
        rows: [n] the batch rows that sampled, in the order of `sampled`.
        sampled: [n] int64 on the device, the sampled ids (kept alive here
            until copied: the copy stream reads it).
        logprobs: the sampled rows' logprobs on the device, or None.
        fill: called once per sampled row with (row index in `rows`, token
            id) to put the id where the runner left a placeholder.
        copy_stream: the CUDA stream that copies to the host; None on the CPU,
            where the tensors are already on the host.
        compute_stream: the stream the sampler ran on, the current stream (the
            copy waits for it); None on the CPU.
        sampled_ready: an event this call records on `compute_stream` for the copy
            stream to wait on (re-recorded each step: a wait takes the record made
            before it); None on the CPU.
        sampled_host: [>= n] int64 pinned host memory the sampled ids are copied
            into, not read or written by anyone else until `get_output()`; None:
            a new pinned tensor (`Tensor.to`).
    """

    def __init__(
        self,
        output: ModelRunnerOutput,
        rows: np.ndarray,
        sampled: torch.Tensor,
        logprobs: LogprobsTensors | None,
        fill: Callable[[int, int], None],
        copy_stream: torch.cuda.Stream | None,
        compute_stream: torch.cuda.Stream | None,
        sampled_ready: torch.cuda.Event | None = None,
        sampled_host: torch.Tensor | None = None,
    ) -> None:
        self._output = output
        self._rows = rows.tolist()
        self._fill: Callable[[int, int], None] | None = fill
        tensors = [sampled]
        if logprobs is not None:
            tensors += [
                logprobs.logprob_token_ids, logprobs.logprobs, logprobs.selected_token_ranks
            ]
        self._device_tensors: list[torch.Tensor] | None = tensors
        self._event: torch.cuda.Event | None = None
        if copy_stream is None:
            self._host = tensors
            return
        # The copy waits for the sampler (on the compute stream) and nothing
        # else; the host waits for the copy only in get_output(). The streams are
        # switched with set_stream, not `with torch.cuda.stream(...)` (its device and
        # stream lookups cost ~30 us a step on the H200 host, issue 10), and the
        # event the copy waits on is reused (wait_stream creates one per call).
        sampled_ready.record(compute_stream)
        copy_stream.wait_event(sampled_ready)
        torch.cuda.set_stream(copy_stream)
        try:
            if sampled_host is not None and sampled.dtype == sampled_host.dtype:
                # A copy into pinned memory kept for it: ~15 us less host time than .to
                sampled_host = sampled_host[: sampled.shape[0]]
                sampled_host.copy_(sampled, non_blocking=True)
                self._host = [sampled_host]
            else:
                self._host = [tensors[0].to("cpu", non_blocking=True)]  # pinned
            self._host += [t.to("cpu", non_blocking=True) for t in tensors[1:]]
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)
        finally:
            torch.cuda.set_stream(compute_stream)

    def get_output(self) -> ModelRunnerOutput:
        if self._fill is None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host[0].tolist()
        output = self._output
        for i, (row, token_id) in enumerate(zip(self._rows, token_ids, strict=True)):
            output.sampled_token_ids[row] = [token_id]
            self._fill(i, token_id)
        if len(self._host) > 1:
            lists = LogprobsTensors(*self._host[1:]).tolists()
            output.logprobs = scatter_logprobs(lists, self._rows, len(output.req_ids))
        self._fill = self._device_tensors = None  # done; free the device tensors
        return output


def scatter_logprobs(lists: LogprobsLists, rows: list[int], num_reqs: int) -> LogprobsLists:
    """Spread logprobs of the sampled `rows` over all `num_reqs` rows (empty for the others)."""
    if len(rows) == num_reqs:
        return lists
    ids: list[list[int]] = [[] for _ in range(num_reqs)]
    lps: list[list[float]] = [[] for _ in range(num_reqs)]
    ranks = [0] * num_reqs
    for i, row in enumerate(rows):
        ids[row] = lists.logprob_token_ids[i]
        lps[row] = lists.logprobs[i]
        ranks[row] = lists.ranks[i]
    return LogprobsLists(ids, lps, ranks)


class AsyncStepState:
    """The runner's async-scheduling state: the last step's sampled ids and their way home.

    Args:
        max_num_reqs: most rows of a step.
        device: the model's device (a copy stream and events on CUDA).
        max_model_len: most tokens a row holds (a placeholder past it is not stored).

    Invariant (kept by the engine core): `get_output()` of step N is called
    before step N+2 is prepared, so only the last step's ids can still be
    placeholders on the host, and each is its request's last token.
    """

    def __init__(self, max_num_reqs: int, device: torch.device, max_model_len: int) -> None:
        cuda = device.type == "cuda"
        self.max_model_len = max_model_len
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        # Looked up once: torch.cuda.current_stream() costs a few microseconds a
        # call, and the runner launches every step on this stream.
        self.compute_stream = torch.cuda.current_stream(device) if cuda else None
        self.sampled_ready = torch.cuda.Event() if cuda else None
        # The pinned staging buffers are rewritten each step while the device
        # may still be copying the last step's values out of them: this event,
        # recorded after a step's last host-to-device copy, is waited on first
        # (one event, re-recorded each step once the last record was waited on).
        self._inputs_copied = torch.cuda.Event() if cuda else None
        self._inputs_recorded = False
        # (sampled ids [n] int64 on the device, req_id -> index) of the last step.
        self.prev_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.pending: AsyncRunnerOutput | None = None
        # [0]: flat input positions, [1]: indices into the last step's sampled ids.
        self.feed_indices = torch.zeros(2, max_num_reqs, dtype=torch.int64, device=device)
        self.feed_indices_cpu = torch.zeros(2, max_num_reqs, dtype=torch.int64, pin_memory=cuda)
        self._feed_indices_np = self.feed_indices_cpu.numpy()  # made once: microseconds a call
        # Where each step's sampled ids land on the host: two pinned rows used in turn.
        # Step N's row is read by its get_output(), which the engine calls before step
        # N + 2 (the class invariant) rewrites the row.
        sampled_host = torch.zeros(2, max_num_reqs, dtype=torch.int64, pin_memory=cuda)
        self._sampled_host = (sampled_host[0], sampled_host[1])
        self._sampled_turn = 0

    def wait_inputs_copied(self) -> None:
        if self._inputs_recorded:
            self._inputs_copied.synchronize()

    def record_inputs_copied(self) -> None:
        if self._inputs_copied is not None:
            self._inputs_copied.record(self.compute_stream)
            self._inputs_recorded = True

    def feed(
        self, input_ids: torch.Tensor, batch: InputBatch, num_sched: np.ndarray,
        computed: np.ndarray, cu: np.ndarray,
    ) -> None:
        """Put the last step's sampled ids into `input_ids` [max_num_tokens], on the device.

        A row whose last token is still a placeholder on the host sampled it
        last step; when this step computes that position, its input id is
        copied from the sampled ids (no host round trip).
        """
        if self.prev_sampled is None:
            return
        sampled, index_of = self.prev_sampled
        idx = self._feed_indices_np
        n = 0
        for row, req_id in enumerate(batch.req_ids):
            i = index_of.get(req_id)
            pos = int(batch.num_tokens[row]) - 1
            if i is None or batch.token_ids[row, pos] != PLACEHOLDER_TOKEN_ID:
                continue
            offset = pos - int(computed[row])
            if 0 <= offset < num_sched[row]:
                idx[0, n], idx[1, n] = cu[row] - num_sched[row] + offset, i
                n += 1
        if n and idx[1, 0] == 0 and (n == 1 or (
                (np.diff(idx[0, :n]) == 1).all() and (np.diff(idx[1, :n]) == 1).all())):
            # The usual decode step: this step's rows take the last step's ids in
            # order, at consecutive positions: one device copy, no index upload.
            start = int(idx[0, 0])
            input_ids[start : start + n].copy_(sampled[:n])
        elif n:
            self.feed_indices[:, :n].copy_(self.feed_indices_cpu[:, :n], non_blocking=True)
            dst, src = self.feed_indices[0, :n], self.feed_indices[1, :n]
            input_ids.index_copy_(0, dst, sampled.index_select(0, src).to(input_ids.dtype))

    def output(
        self, output: ModelRunnerOutput, rows: np.ndarray, sampler_output: SamplerOutput | None,
        batch: InputBatch,
    ) -> ModelRunnerOutput | AsyncRunnerOutput:
        """Leave placeholders on the host and start copying the sampled ids there.

        A step that sampled nothing (`sampler_output` None: only partial prefills)
        returns `output` as it is, and the next step has no ids to take.
        """
        if sampler_output is None:
            self.prev_sampled = None
            return output
        states = [batch.states[r] for r in rows]
        for row, state in zip(rows.tolist(), states, strict=True):
            state.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
            batch.append_token(row, PLACEHOLDER_TOKEN_ID)
        indices = [len(s.output_token_ids) - 1 for s in states]

        def fill(i: int, token_id: int) -> None:
            self._fill_placeholder(batch, states[i], indices[i], token_id)

        sampled = sampler_output.sampled_token_ids
        self.prev_sampled = (sampled, {s.req_id: i for i, s in enumerate(states)})
        self._sampled_turn ^= 1
        self.pending = AsyncRunnerOutput(
            output, rows, sampled, sampler_output.logprobs_tensors, fill, self.copy_stream,
            self.compute_stream, self.sampled_ready, self._sampled_host[self._sampled_turn],
        )
        return self.pending

    def _fill_placeholder(
        self, batch: InputBatch, state: CachedRequestState, index: int, token_id: int
    ) -> None:
        """Put a sampled id where `output` left a placeholder (request state and batch row)."""
        state.output_token_ids[index] = token_id
        row = batch.req_id_to_index.get(state.req_id)
        position = state.num_prompt_tokens + index
        in_batch = row is not None and batch.states[row] is state
        if in_batch and position < self.max_model_len:
            batch.token_ids[row, position] = token_id
