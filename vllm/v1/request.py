"""The engine core's view of one request: its tokens, progress and status (torch-free)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, overload

from vllm.v1.outputs import FinishReason

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is. Members after PREEMPTED are the finished states."""

    WAITING = enum.auto()
    # Its blocks are allocated and a KV connector loads its prompt's KV in the
    # background (vLLM's state of the same name); it keeps its place in the waiting
    # queue and is scheduled once the load is reported done.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    # Its structured-output grammar compiles in the background (vLLM's state of the
    # same name); it keeps its place in the waiting queue, holds no blocks, and is
    # scheduled once the grammar is ready (v1/core/sched/structured_outputs.py).
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Finished states, ordered after every unfinished one (see is_finished).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def waits_in_background(status: RequestStatus) -> bool:
        """Waiting for background work (a KV load, a grammar compile): not schedulable yet."""
        return status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING_FOR_FSM)

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        """The FinishReason of a finished status; None while unfinished."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # vLLM reports a request ignored for its length as "length".
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class ConstantList(Sequence[int]):
    """A read-only view of a list of token ids (no copy on access)."""

    __slots__ = ("_x",)

    def __init__(self, x: list[int]) -> None:
        self._x = x

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index):
        return self._x[index]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self):
        return iter(self._x)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._x == other._x
        return self._x == other

    __hash__ = None  # type: ignore[assignment]  # mutable underneath

    def __repr__(self) -> str:
        return f"ConstantList({self._x!r})"


class Request:
    """One generation request as the scheduler tracks it.

    Args:
        request_id: unique among unfinished requests.
        prompt_token_ids: the prompt, token ids.
        sampling_params: a `vllm.SamplingParams`; the core reads max_tokens
            (None = until max_model_len), min_tokens, ignore_eos,
            stop_token_ids and prompt_logprobs.
        eos_token_id: the tokenizer's EOS id, or None for none.
        arrival_time: seconds since the epoch; defaults to now.
        cache_salt: optional string mixed into the first block's hash, so only
            requests with the same salt share prefix-cache blocks.
        mm_features: the prompt's images (`vllm.multimodal.inputs.MultiModalFeatureSpec`,
            in prompt order): where their placeholder tokens are, their pixels and
            hashes; empty for a text prompt.
        priority: the scheduling priority under `--scheduling-policy priority`:
            lower is admitted first and preempted last, ties by arrival_time
            (v1/core/sched/request_queue.py); 0 under fcfs.

    Attributes (vLLM's names):
        num_computed_tokens: tokens whose KV is in the cache or scheduled into
            it (the scheduler advances it when it schedules them).
        num_cached_tokens: prompt tokens served by the prefix cache when the
            request was first scheduled; -1 until then.
        block_hashes: hashes of the request's full blocks, filled by the KV
            cache manager (see kv_cache_utils.update_request_block_hashes).
        num_preemptions: how often the request was preempted.
        spec_token_ids: draft tokens proposed after the last step (speculative
            decoding), verified by the next step that schedules them; not part
            of the token ids until accepted.
        num_output_placeholders: tokens scheduled to be sampled whose ids the
            scheduler has not seen yet (async scheduling: the step that samples
            them is still running); 0 with synchronous scheduling.
        stop_reason: the stop token id (or, set by the engine, stop string) that matched.
        grammar: the compiled grammar of a structured-output request once its
            compile finished (a `vllm.v1.structured_output.CompiledGrammar`), else None.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | Any,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        mm_features: list[Any] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = list(mm_features or [])

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens: int | None = sampling_params.max_tokens

        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)

        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.block_hashes: list[bytes] = []  # kv_cache_utils.BlockHash digests
        self.num_preemptions = 0
        # time.monotonic() when first scheduled (the end of its queue time), for metrics.
        self.first_scheduled_time: float | None = None
        self.spec_token_ids: list[int] = []
        self.num_output_placeholders = 0
        self.grammar: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled token(s) to the output and to all_token_ids."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self._output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
