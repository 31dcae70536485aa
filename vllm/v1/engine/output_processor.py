"""Turns EngineCoreOutputs into RequestOutputs: text, logprobs, n > 1, timing.

    EngineCoreOutput (token ids, logprobs, finish)
        -> RequestState (detokenizer, logprobs so far, timing)
        -> ParentRequest (n > 1: gathers its children's CompletionOutputs)
        -> RequestOutput (returned, or pushed to the request's queue)

Stop strings are found here; their requests are returned in `reqs_to_abort`
so the engine can finish them in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.exceptions import KVTransferError
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, RequestTimes
from vllm.v1.outputs import EngineCoreOutput, FinishReason, LogprobsLists

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class ParentRequest:
    """A request with n > 1: n child requests sampled independently."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self.outputs: list[CompletionOutput | None] = [None] * n
        self.num_finished = 0

    @staticmethod
    def child_id(index: int, request_id: str) -> str:
        return f"{index}_{request_id}"

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Child `index` samples alone (n = 1); a seed is offset so children differ."""
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index
        return child

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    times: RequestTimes
    parent: ParentRequest | None = None
    index: int = 0
    queue: Any = None  # for AsyncLLM: an object with put_nowait(RequestOutput | Exception)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # the KV connector's, on the finished output
    token_ids: list[int] = field(default_factory=list)
    # DELTA outputs: how many token ids / logprob entries were already sent.
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    stats: IterationStats


class OutputProcessor:
    """Detokenizes and assembles outputs for every live request.

    Args:
        tokenizer: used for text and for logprob tokens' text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text alone
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
    ) -> None:
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already running")
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            times=RequestTimes(arrival=arrival_time),
            parent=parent,
            index=index,
            queue=queue,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self.states[request_id] = state
        if parent is not None:
            self.parents[parent.request_id] = parent

    def abort_requests(
        self, request_ids: list[str], stats: IterationStats | None = None
    ) -> list[str]:
        """Forget requests (ids of children or parents); returns the child ids dropped.

        `stats`: where an abort (a client gone, `AsyncLLM.abort`) is counted as a
        finished request with reason "abort" (vLLM's `request_success{finished_reason=
        "abort"}`, its end-to-end latency and per-request figures), one per child
        dropped; None for requests that failed or were never admitted.
        """
        now = time.monotonic()
        dropped = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            ids = [ParentRequest.child_id(i, rid) for i in range(parent.n)] if parent else [rid]
            for child in ids:
                state = self.states.pop(child, None)
                if state is None:
                    continue
                dropped.append(child)
                if stats is not None:
                    self._count_finished(state, FinishReason.ABORT, now, stats)
        return dropped

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        now = time.monotonic()
        stats = IterationStats()
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:  # aborted meanwhile
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if out.error is not None:
                self._update_timing(state, out, len(out.new_token_ids), now, stats)
                self._fail(state, out.error, out.error_param)
                continue
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            finish_reason = out.finish_reason
            stop_reason = out.stop_reason
            stop_string, num_kept = state.detokenizer.update(
                out.new_token_ids, stop_terminated=finish_reason == FinishReason.STOP
            )
            new_token_ids = out.new_token_ids
            new_logprobs = out.new_logprobs
            if num_kept < len(new_token_ids):
                # A stop string ended among this step's tokens (accepted drafts): the
                # output ends at the token that completed it, whatever the core saw after
                # (a stop token, EOS or max_tokens included). Nothing after it is output.
                new_token_ids = new_token_ids[:num_kept]
                if new_logprobs is not None:
                    new_logprobs = new_logprobs.slice(0, num_kept)
                if finish_reason is None:
                    reqs_to_abort.append(out.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            elif stop_string is not None and finish_reason is None:
                finish_reason, stop_reason = FinishReason.STOP, stop_string
                reqs_to_abort.append(out.request_id)
            self._update_timing(state, out, len(new_token_ids), now, stats)
            state.token_ids.extend(new_token_ids)
            self._update_logprobs(state, new_logprobs, out.new_prompt_logprobs)
            finished = finish_reason is not None
            if finished:
                del self.states[out.request_id]
                self._count_finished(state, finish_reason, now, stats)
            request_output = self._make_request_output(state, finish_reason, stop_reason)
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put_nowait(request_output)
                else:
                    request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort, stats)

    # ---------------------------------------------------------------- helpers
    def _fail(self, state: RequestState, error: str, param: str | None = None) -> None:
        """A request the core failed on its own: the stream gets the error, a
        `VLLMValidationError` naming `param` (its grammar did not compile: HTTP 400),
        else a `KVTransferError` (its KV transfer failed: 502).

        The offline `LLM` has no stream: it logs and drops the request. `param` is
        the request field the grammar came from (`StructuredOutputsParams.source_field`:
        response_format, guided_json, tools, ...), named by the core.
        """
        del self.states[state.request_id]
        if state.queue is not None:
            state.queue.put_nowait(KVTransferError(error) if param is None
                                   else VLLMValidationError(error, parameter=param))
        else:
            logger.error("request %s failed: %s", state.request_id, error)

    @staticmethod
    def _update_timing(
        state: RequestState, out: EngineCoreOutput, n: int, now: float, stats: IterationStats
    ) -> None:
        """`n`: the step's new tokens that are output (not those after a stop string)."""
        times = state.times
        if times.first_scheduled is None and out.first_scheduled_time is not None:
            times.first_scheduled = out.first_scheduled_time
        if n == 0:
            return
        if times.first_token is None:
            times.first_token = now
            stats.time_to_first_tokens.append(now - times.arrival)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        elif times.last_token is not None:
            stats.inter_token_latencies.append(now - times.last_token)
        times.last_token = now
        stats.num_generation_tokens += n

    def _count_finished(
        self, state: RequestState, reason: FinishReason, now: float, stats: IterationStats
    ) -> None:
        stats.finished_reasons.append(str(reason))
        stats.e2e_latencies.append(now - state.times.arrival)
        stats.finished_requests.append(self._finished_stats(state, now))

    @staticmethod
    def _finished_stats(state: RequestState, now: float) -> FinishedRequestStats:
        """The phases of a request that just finished (0 for a phase it never reached)."""
        t = state.times
        scheduled = t.first_scheduled if t.first_scheduled is not None else now
        first = t.first_token if t.first_token is not None else now
        last = t.last_token if t.last_token is not None else now
        return FinishedRequestStats(
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=len(state.token_ids),
            queue_time=max(scheduled - t.arrival, 0.0),
            prefill_time=max(first - scheduled, 0.0),
            decode_time=max(last - first, 0.0),
            inference_time=max(last - scheduled, 0.0),
        )

    def _update_logprobs(
        self,
        state: RequestState,
        new_logprobs: LogprobsLists | None,
        new_prompt_logprobs: LogprobsLists | None,
    ) -> None:
        if state.logprobs is not None and new_logprobs is not None:
            self._append_logprobs(state.logprobs, new_logprobs, state.params.logprobs, state,
                                  detokenize=state.params.detokenize)
        if state.prompt_logprobs is not None and new_prompt_logprobs is not None:
            self._append_logprobs(
                state.prompt_logprobs, new_prompt_logprobs, state.params.prompt_logprobs,
                detokenize=state.params.detokenize,
            )

    def _append_logprobs(
        self,
        dest: list,
        lists: LogprobsLists,
        num_logprobs: int,
        state: RequestState | None = None,
        detokenize: bool = True,
    ) -> None:
        # detokenize=False leaves Logprob.decoded_token None, as in vLLM.
        text = self._token_text if detokenize else (lambda _token_id: None)
        if num_logprobs < 0:  # -1: the whole vocabulary (the worker got a count)
            num_logprobs = len(self.tokenizer)
        for ids, lps, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.ranks, strict=True
        ):
            if not ids:
                continue
            entry: dict[int, Logprob] = {}
            # Column 0 is the chosen token; 1..k the top-k (the chosen token
            # may be among them, and then keeps its true rank).
            entry[ids[0]] = Logprob(lps[0], rank, text(ids[0]))
            for i in range(1, min(num_logprobs, len(ids) - 1) + 1):
                if ids[i] not in entry:
                    entry[ids[i]] = Logprob(lps[i], i, text(ids[i]))
            dest.append(entry)
            if state is not None and state.cumulative_logprob is not None:
                state.cumulative_logprob += lps[0]

    def _token_text(self, token_id: int) -> str:
        # Cached: a whole-vocabulary request (logprobs -1) decodes every id per position.
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _make_request_output(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completion = self._completion(state, finish_reason, stop_reason, delta)
        parent = state.parent
        if parent is None:
            return self._request_output(state, state.request_id, [completion], finished)
        # n > 1: the parent speaks for its children.
        if finished:
            parent.num_finished += 1
        if delta:
            done = parent.finished
            if done:
                self.parents.pop(parent.request_id, None)
            return self._request_output(state, parent.request_id, [completion], done)
        parent.outputs[state.index] = completion
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        done = parent.finished
        if done:
            self.parents.pop(parent.request_id, None)
        outputs = [o for o in parent.outputs if o is not None]
        return self._request_output(state, parent.request_id, outputs, done)

    def _completion(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        delta: bool,
    ) -> CompletionOutput:
        finished = finish_reason is not None
        text = state.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = state.token_ids[state.num_sent_tokens :]
            state.num_sent_tokens = len(state.token_ids)
            logprobs = None
            if state.logprobs is not None:
                logprobs = state.logprobs[state.num_sent_logprobs :]
                state.num_sent_logprobs = len(state.logprobs)
        else:
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )

    @staticmethod
    def _request_output(
        state: RequestState, request_id: str, outputs: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )
