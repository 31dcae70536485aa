"""Input processing: a user's prompt and SamplingParams -> a validated core Request.

Shared by `LLMEngine` (offline) and `AsyncLLM` (server), so the two accept and
reject exactly the same inputs with the same messages.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_transfer_params import (
    check_kv_transfer_params,
    check_kv_transfer_request,
)
from vllm.exceptions import VLLMValidationError
from vllm.inputs import check_unicode_text
from vllm.sampling_params import MAX_LOGPROBS, SamplingParams, validate_request_lengths
from vllm.v1.engine.output_processor import ParentRequest
from vllm.v1.request import Request
from vllm.v1.structured_output import prepare_parser, validate_structured_outputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.config import VllmConfig
    from vllm.inputs import PromptType
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.processing import MultiModalProcessor


@dataclass
class ProcessedRequest:
    """A validated request, fanned out into the core requests that compute it.

    Attributes:
        text: the prompt text (None for token ids alone).
        prompt_token_ids: the prompt.
        children: (core Request, its ParentRequest or None, its index) for each
            of the `n` samples (one, with no parent, when n == 1).
    """

    text: str | None
    prompt_token_ids: list[int]
    children: list[tuple[Request, ParentRequest | None, int]]


class Processor:
    """Tokenizes and validates prompts.

    Args:
        tokenizer: the model's tokenizer.
        max_model_len: tokens a request may hold (prompt + output).
        vocab_size: token ids must be below it.
        max_num_seqs: the most sequences one step runs (the scheduler's limit);
            a request's `n` may not exceed it.
        generation_config: the model's generation config
            (`ModelConfig.try_get_generation_config`); its `eos_token_id` ids
            stop every request, as the tokenizer's EOS does.
        max_logprobs: the most logprobs (sample or prompt) a request may ask
            for; -1 = the whole vocabulary (vLLM's `--max-logprobs`).
        kv_connector: the KV connector's name, or None without one.
        block_size: tokens per KV block (what remote blocks of a transfer hold).
        compact_json: `--structured-outputs-config` disable_any_whitespace: every
            JSON constraint is compiled without optional whitespace.
        mm_processor: the model's `MultiModalProcessor` (images -> features and
            expanded placeholders); None for a text-only model, which refuses
            a prompt's "multi_modal_data".
        scheduling_policy: "fcfs" or "priority" (`--scheduling-policy`); under
            fcfs a request's priority must be 0.
        structured_outputs_backend: `--structured-outputs-config`'s backend, which
            must parse a request's constraint.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        vocab_size: int,
        max_num_seqs: int,
        generation_config: dict | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        kv_connector: str | None = None,
        block_size: int = 16,
        compact_json: bool = False,
        mm_processor: MultiModalProcessor | None = None,
        scheduling_policy: str = "fcfs",
        structured_outputs_backend: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.kv_connector = kv_connector
        self.block_size = block_size
        self.compact_json = compact_json
        self.eos_token_id = tokenizer.eos_token_id
        self.generation_config = generation_config or {}
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.mm_processor = mm_processor
        self.scheduling_policy = scheduling_policy
        self.structured_outputs_backend = structured_outputs_backend
        prepare_parser(structured_outputs_backend)  # in the background: off a request's path

    @classmethod
    def from_config(
        cls, vllm_config: VllmConfig, tokenizer: PreTrainedTokenizerBase, max_model_len: int
    ) -> Processor:
        """The processor of an engine whose KV cache holds `max_model_len` tokens a request."""
        model_config = vllm_config.model_config
        kv = vllm_config.kv_transfer_config
        mm_processor = None
        if model_config.is_multimodal_model:
            from vllm.multimodal.processing import MultiModalProcessor

            mm = vllm_config.multimodal_config
            mm_processor = MultiModalProcessor.for_checkpoint(
                model_config.model, model_config.hf_config, mm.limit_mm_per_prompt,
                max_model_len, mm.allowed_local_media_path)
        return cls(
            tokenizer,
            max_model_len,
            model_config.get_vocab_size(),
            vllm_config.scheduler_config.max_num_seqs,
            model_config.try_get_generation_config(),
            model_config.max_logprobs,
            kv_connector=kv.kv_connector if kv else None,
            block_size=vllm_config.cache_config.block_size,
            compact_json=vllm_config.structured_outputs_config.disable_any_whitespace,
            mm_processor=mm_processor,
            scheduling_policy=vllm_config.scheduler_config.policy,
            structured_outputs_backend=vllm_config.structured_outputs_config.backend,
        )

    def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
        *, require_room_for_max_tokens: bool = False,
    ) -> ProcessedRequest:
        """Validate and tokenize a request; n > 1 fans out into n child requests.

        Every child is validated before any is returned, so a rejection queues
        nothing. `priority` (vLLM's): lower is scheduled first under
        `--scheduling-policy priority`; every child has it.
        `require_room_for_max_tokens`: the OpenAI server's rule (prompt +
        max_tokens must fit max_model_len); the engine's own rule, for `LLM`
        and direct engine callers, only needs the prompt to fit
        (`validate_request_lengths`).

        Raises:
            VLLMValidationError: see `validate_params`, `tokenize`, `make_request`;
                parameter "priority": not an int, or non-zero under the fcfs policy
                (vLLM refuses it there too).
        """
        self.validate_priority(priority)
        self.validate_params(params)
        text, prompt_token_ids = self.tokenize(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the last `keep` tokens (-1: max_model_len), as vLLM
            prompt_token_ids = prompt_token_ids[-(self.max_model_len if keep == -1 else keep):]
        prompt_token_ids, mm_features = self.process_multimodal(prompt, prompt_token_ids)
        check_kv_transfer_request((params.extra_args or {}).get("kv_transfer_params"),
                                  len(prompt_token_ids), self.block_size, params.n)
        room = require_room_for_max_tokens
        if params.n == 1:
            request = self.make_request(request_id, prompt_token_ids, params,
                                        mm_features=mm_features, priority=priority,
                                        require_room_for_max_tokens=room)
            return ProcessedRequest(text, prompt_token_ids, [(request, None, 0)])
        parent = ParentRequest(request_id, params.n)
        children = [
            (self.make_request(ParentRequest.child_id(i, request_id), prompt_token_ids,
                               ParentRequest.child_params(params, i), mm_features=mm_features,
                               priority=priority, require_room_for_max_tokens=room),
             parent, i)
            for i in range(params.n)
        ]
        return ProcessedRequest(text, prompt_token_ids, children)

    def validate_priority(self, priority: int) -> None:
        """A request's priority: an int (any sign), 0 unless the policy is "priority"."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise VLLMValidationError(f"priority must be an integer, got {priority!r:.40}",
                                      parameter="priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise VLLMValidationError(
                f"Got priority {priority} but priority scheduling is not enabled: start the "
                "engine with --scheduling-policy priority (default: fcfs)", parameter="priority")

    def validate_params(self, params: SamplingParams) -> None:
        """Engine limits SamplingParams cannot know: `n` <= max_num_seqs, logprobs <= max.

        Why the bound: the n samples of a prompt are n sequences; more than a
        step can run would never finish together, and a huge n (10**6) only
        allocates per-sample state while every other client waits.

        Raises:
            VLLMValidationError (parameter "n"): naming n and max_num_seqs.
            VLLMValidationError (parameter "truncate_prompt_tokens"): above max_model_len.
            VLLMValidationError (parameter "logprobs" / "prompt_logprobs"): more
                than `max_logprobs` (vLLM's message).
            VLLMValidationError (parameter "kv_transfer_params"): malformed, or
                sent to an engine without a KV connector.
            VLLMValidationError (parameter "json", "regex", "choice", "grammar" or
                "structural_tag"): a structured-output constraint the engine's
                backend cannot parse; decided here, so it never reaches the engine.
        """
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(params, name)
            num = self.vocab_size if asked == -1 else asked
            if num is not None and num > self.max_logprobs:
                raise VLLMValidationError(
                    f"Requested {what} logprobs of {num}, which is greater than max allowed: "
                    f"{self.max_logprobs} (--max-logprobs; -1 asks for the whole vocabulary)",
                    parameter=name,
                )
        validate_structured_outputs(params.structured_outputs, self.structured_outputs_backend)
        extra = params.extra_args or {}
        check_kv_transfer_params(extra.get("kv_transfer_params"), self.kv_connector)
        if params.n > self.max_num_seqs:
            raise VLLMValidationError(
                f"n ({params.n}) must be <= max_num_seqs ({self.max_num_seqs}), the most "
                "sequences this engine runs at once; ask for fewer samples per request",
                parameter="n",
            )
        keep = params.truncate_prompt_tokens
        if keep is not None and keep > self.max_model_len:  # vLLM refuses it too
            raise VLLMValidationError(
                f"truncate_prompt_tokens ({keep}) must be <= max_model_len "
                f"({self.max_model_len}); -1 keeps the last max_model_len tokens",
                parameter="truncate_prompt_tokens")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids).

        Raises:
            VLLMValidationError (parameter "prompt"): empty prompt, text that is
                not valid Unicode (a lone UTF-16 surrogate), token ids outside
                [0, vocab_size), or an unsupported prompt type.
        """
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict):
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if text is None and token_ids is None:
                raise _prompt_error("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, list | tuple):
            text, token_ids = None, list(prompt)
        else:
            raise _prompt_error(
                f"prompt must be a string, a list of token ids or a prompt dict, not "
                f"{type(prompt).__name__}"
            )
        if text is not None:  # also when token ids come with it: outputs echo the text
            if not isinstance(text, str):
                raise _prompt_error(f"the prompt text must be a string, not {type(text).__name__}")
            check_unicode_text(text, "prompt")
        if token_ids is None:
            if not text:
                raise _prompt_error("the prompt is empty")
            token_ids = self.tokenizer.encode(text)
        token_ids = list(token_ids)
        if not token_ids:
            raise _prompt_error("the prompt is empty (0 tokens)")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise _prompt_error(
                f"prompt token id {bad[0]!r} is out of range [0, {self.vocab_size})"
            )
        return text, token_ids

    def process_multimodal(self, prompt: PromptType, prompt_token_ids: list[int]
                           ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """A prompt dict's "multi_modal_data" -> (token ids with the placeholders
        expanded, the images' features); a prompt without images is returned as is.

        Raises:
            VLLMValidationError (parameter "multi_modal_data...", or the chat part
                an image came from: the prompt's "multi_modal_params"): images for a
                text-only model, or what `MultiModalProcessor.process` refuses.
        """
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not mm_data:
            return prompt_token_ids, []
        if self.mm_processor is None:
            raise VLLMValidationError(
                "multi_modal_data: this model is text-only and takes no images",
                parameter="multi_modal_data")
        params = prompt.get("multi_modal_params")  # a chat's: the text is "messages"
        return self.mm_processor.process(prompt_token_ids, mm_data,
                                         "messages" if params else "multi_modal_data", params)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        priority: int = 0,
        *,
        require_room_for_max_tokens: bool = False,
    ) -> Request:
        """A core Request for one (child) request.

        Checks lengths against max_model_len (vLLM's two rules: the engine's
        only needs the prompt to leave room for one token, and generation stops
        at max_model_len with finish_reason "length"; the OpenAI server's,
        `require_room_for_max_tokens`, also needs prompt + max_tokens to fit),
        logit_bias ids against the vocabulary, and makes EOS part of the stop
        set that min_tokens masks.

        Raises:
            VLLMValidationError: naming the numbers and the parameter at fault.
        """
        params = params.clone()  # one per request: the fields below are per prompt
        params.max_tokens = validate_request_lengths(
            len(prompt_token_ids), params.max_tokens, self.max_model_len,
            require_room_for_max_tokens=require_room_for_max_tokens,
        )
        params.verify_vocab(self.vocab_size)
        # -1 = the whole vocabulary; the worker only ever sees a count.
        if params.logprobs == -1:
            params.logprobs = self.vocab_size
        if params.prompt_logprobs == -1:
            params.prompt_logprobs = self.vocab_size
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        so = params.structured_outputs
        if so is not None and self.compact_json and not so.disable_any_whitespace:
            params.structured_outputs = dataclasses.replace(so, disable_any_whitespace=True)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            mm_features=mm_features,
            priority=priority,
        )


def _prompt_error(message: str) -> VLLMValidationError:
    return VLLMValidationError(message, parameter="prompt")
