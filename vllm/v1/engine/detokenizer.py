"""Incremental detokenization and stop strings.

Text is produced token by token with `tokenizers.decoders.DecodeStream`, which
holds back bytes until they form valid UTF-8 (a multi-byte character split over
tokens never shows up as U+FFFD). Slow (pure-Python) tokenizers fall back to
decoding the whole output each step.

Stop strings are matched here, not in the scheduler (which never sees text),
once the output has more than `min_tokens` tokens (vLLM's rule): when one
appears the text is cut before it (or after it with
`include_stop_str_in_output`), and the engine aborts the request in the core
with FINISHED_STOPPED. They are checked token by token, so when a step brings
several tokens (accepted drafts) the output ends at the token that completes
the stop string: the tokens after it are not output, nor counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.sampling_params import SamplingParams

# Prompt tokens fed to the stream before the first output token, so the first
# piece of text is decoded in context (e.g. SentencePiece's leading space).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, one step at a time.

    Args:
        tokenizer: the model's tokenizer (fast tokenizers decode incrementally).
        prompt_token_ids: the prompt, for decoding context.
        params: skip_special_tokens, stop, include_stop_str_in_output, detokenize.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.enabled = params.detokenize
        self.output_text = ""
        self.token_ids: list[int] = []
        stop = params.stop
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        # Text kept back from a streaming client while it could still be the
        # start of a stop string.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        if params.include_stop_str_in_output:
            self.holdback = 0
        self._sent = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = None
        if backend is not None and self.enabled:
            self._stream = DecodeStream(
                ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
                skip_special_tokens=params.skip_special_tokens,
            )

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Append tokens; returns (the stop string that matched or None, tokens kept).

        `stop_terminated` is True when the core already finished the request on
        a stop token or EOS, whose text is not part of the output.

        Stop strings are checked after each token: with speculative decoding one
        step brings several tokens, and the output ends at the token that
        completes a stop string, as if they had come one a step. The tokens after
        it are dropped (from `token_ids` too); the count kept tells the caller how
        many of `new_token_ids` (and of their logprobs) belong to the output.
        """
        if not self.enabled or not new_token_ids:
            self.token_ids.extend(new_token_ids)
            return None, len(new_token_ids)
        # The text of the stop token / EOS that ended the request is left out
        # unless asked for (its id stays in token_ids, as in vLLM).
        skip_last = stop_terminated and not self.params.include_stop_str_in_output
        num_texted = len(new_token_ids) - 1 if skip_last else len(new_token_ids)
        for i, token_id in enumerate(new_token_ids[:num_texted]):
            start = len(self.output_text)
            self.token_ids.append(token_id)
            if self._stream is not None:
                piece = self._stream.step(self._backend, token_id)
                if piece:
                    self.output_text += piece
            else:
                self.output_text = self.tokenizer.decode(
                    self.token_ids,
                    skip_special_tokens=self.params.skip_special_tokens,
                    spaces_between_special_tokens=self.params.spaces_between_special_tokens,
                )
            # As vLLM: no stop string ends an output of min_tokens tokens or fewer.
            stop = (self._check_stop_strings(start)
                    if len(self.token_ids) > self.params.min_tokens else None)
            if stop is not None:
                # Ends here: the later tokens (a stop token / EOS included) are not output.
                return stop, i + 1
        self.token_ids.extend(new_token_ids[num_texted:])
        return None, len(new_token_ids)

    def _check_stop_strings(self, new_start: int) -> str | None:
        if not self.stop:
            return None
        text = self.output_text
        for stop in self.stop:
            # A match must end inside the new text; it may begin before it.
            search_from = max(0, new_start - len(stop) + 1)
            idx = text.find(stop, search_from)
            if idx != -1:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.output_text = text[:end]
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text, or (delta) what was not returned before."""
        if not delta:
            return self.output_text
        end = len(self.output_text) if finished else max(0, len(self.output_text) - self.holdback)
        end = max(end, self._sent)
        text = self.output_text[self._sent : end]
        self._sent = end
        return text
