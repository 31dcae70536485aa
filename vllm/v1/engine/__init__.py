"""Types that cross from the engine core to the frontends (torch-free)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm.v1.outputs import LogprobsLists


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
