"""What crosses a layer boundary upward each step (torch-free, imports nothing from vllm).

    model runner --ModelRunnerOutput--> scheduler --EngineCoreOutput--> frontend

`ModelRunnerOutput` carries sampled token ids and logprobs per scheduled
request; `EngineCoreOutput` the news of one request (new tokens, logprobs,
finish reason). Both are plain dataclasses so every layer can import them.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field


@dataclass
class LogprobsLists:
    """Top logprobs per row, as Python lists.

    Row r: `logprob_token_ids[r][0]` is the token the logprobs are about (the
    sampled token, or the next prompt token for prompt logprobs) and
    `logprobs[r][0]` its logprob; entries 1..k are the top-k tokens in
    descending order. `ranks[r]` is the 1-based rank of entry 0 in the vocab.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )

    @staticmethod
    def concat(parts: list[LogprobsLists]) -> LogprobsLists:
        """The rows of `parts`, in order, as one (the first part itself when alone)."""
        if len(parts) == 1:
            return parts[0]
        return LogprobsLists([row for p in parts for row in p.logprob_token_ids],
                             [row for p in parts for row in p.logprobs],
                             [r for p in parts for r in p.ranks])


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step (request ids)."""

    finished_sending: set[str] = field(default_factory=set)  # blocks may be freed now
    finished_recving: set[str] = field(default_factory=set)  # external KV is in place
    failed_recving: dict[str, str] = field(default_factory=dict)  # req id -> why the load failed

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # scheduled requests, in the runner's batch order
    req_id_to_index: dict[str, int]
    # One list per request: the tokens sampled this step ([] while a prefill
    # is still partial, i.e. no token was sampled).
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None  # rows aligned with req_ids
    # req_id -> prompt logprobs of the prompt positions computed this step.
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None  # with a KV connector
    # Speculative decoding: per request (rows as req_ids), the drafts proposed
    # for the next step; None without speculative decoding.
    spec_token_ids: list[list[int]] | None = None
    # Async speculative decoding: per request, the drafts the runner verified (<= k').
    num_draft_tokens: list[int] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class AsyncModelRunnerOutput(abc.ABC):
    """A step's output whose sampled ids are still on their way to the host (async scheduling).

    The runner returns it as soon as the step is launched; the engine core
    schedules and launches the next step before calling `get_output()`, so
    the device never waits for the host between the two.
    """

    @abc.abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait for the copy to the host and return the output (idempotent)."""


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI `finish_reason`."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client, or failed

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # time.monotonic() when the request was first scheduled (queue time ends), seconds.
    # CLOCK_MONOTONIC is one clock for every process of the host (engine core included).
    first_scheduled_time: float | None = None
    # With a KV connector, on the finished output: what the next instance
    # needs to fetch this request's KV (vLLM's `kv_transfer_params`).
    kv_transfer_params: dict | None = None
    # A request that failed inside the engine (e.g. its KV transfer): the reason.
    error: str | None = None
    # With `error`: the request field at fault (its grammar did not compile: the
    # constraint's `source_field`), a client error (HTTP 400); None: the engine's side.
    error_param: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class KVCacheMemory:
    """What the KV cache holds now (for metrics), from the worker up to the frontend.

    Attributes:
        committed_bytes: bytes of the committed blocks: num_blocks x bytes per
            block (0 while asleep), the unit of every figure below, so in use <=
            committed <= limit holds and `vllm kv-top` shows the same number.
        reserved_bytes: address space reserved (== committed on the classic path).
        physical_bytes: device memory backing them: whole VMM granules per
            segment, up to about one granule a segment above committed_bytes
            (== on the classic path; 0 while asleep).
        num_blocks: committed blocks, counting the null block.
        block_bytes: bytes of one block over all layers (summed over the ranks).
        num_grows / num_shrinks: how often the elastic cache grew / released
            memory while serving (0 without it).
        in_use_bytes: bytes of the blocks requests hold (the engine core fills it in;
            the null block not counted).
        reclaimable_bytes: what the elastic cache could release now without
            preempting (whole pieces above its floor beyond what its requests
            use; blocks in use are moved below); 0 for a fixed cache.
        limit_bytes: the most the cache may hold: the elastic cache's limit, a
            fixed cache's own blocks (it cannot grow; also while asleep, what it
            wakes to).
        num_reclaims: times it released blocks for another engine on the device.
    """

    committed_bytes: int
    reserved_bytes: int
    num_blocks: int
    num_grows: int = 0
    num_shrinks: int = 0
    in_use_bytes: int = 0
    reclaimable_bytes: int = 0
    limit_bytes: int = 0
    num_reclaims: int = 0
    physical_bytes: int = 0
    block_bytes: int = 0
