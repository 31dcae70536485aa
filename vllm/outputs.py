"""What `LLM.generate` returns: `RequestOutput` holding one `CompletionOutput` per sample.

Field names, order and reprs follow vLLM's so code and logs read the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["CompletionOutput", "Logprob", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: which of the request's `n` completions this is.
        text: generated text (stop string excluded unless requested).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs, or None when
            logprobs were not requested.
        logprobs: per generated token, the top logprobs, or None.
        finish_reason: None while running; "stop" (EOS, stop string or stop
            token), "length" (max_tokens or max_model_len) or "abort".
        stop_reason: the stop string or stop token id that ended it; None for
            EOS, length, or while running.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={list(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


class RequestOutput:
    """The output of one request so far (or final, when `finished`).

    Args:
        request_id: the engine's id for the request.
        prompt: the prompt text, or None for a token-id prompt.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token (first entry None), or None when not requested.
        outputs: one `CompletionOutput` per sample (n of them).
        finished: whether every completion has finished.
        metrics: engine timing figures, if collected.
        num_cached_tokens: prompt tokens served from the prefix cache (or loaded by a
            KV connector).
        kv_transfer_params: what a KV connector returned for the finished request
            (e.g. where the next instance reads its KV), else None.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: Any | None = None,
        num_cached_tokens: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.num_cached_tokens = num_cached_tokens
        self.kv_transfer_params = kv_transfer_params

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )

    def merge(self, later: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one, in place.

        Per completion index: text and token ids (and logprobs) are appended,
        the cumulative logprob, finish and stop reasons are the later ones'; an
        index not seen yet is appended. `finished`, the prompt logprobs, the
        cached-token count and the KV connector's params become the later
        output's (the last two only when it has them). The result is what one
        DELTA output covering both steps would have been: a stream consumer
        that fell behind reads one merged delta instead of several.
        """
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = [*old.token_ids, *new.token_ids]
            if new.logprobs is not None:
                old.logprobs = [*(old.logprobs or []), *new.logprobs]
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
        self.finished = later.finished
        self.prompt_logprobs = later.prompt_logprobs
        if later.num_cached_tokens is not None:
            self.num_cached_tokens = later.num_cached_tokens
        if later.kv_transfer_params is not None:
            self.kv_transfer_params = later.kv_transfer_params
        if later.metrics is not None:
            self.metrics = later.metrics

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and vars(self) == vars(other)

    __hash__ = None  # mutable, like a dataclass with eq
