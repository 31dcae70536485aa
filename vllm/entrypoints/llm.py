"""The offline `LLM` class, as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.inputs import PromptType

logger = init_logger(__name__)

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate text offline with continuous batching over the paged KV cache.

    Args:
        model: an HF model directory or a GGUF file; None serves the bundled
            SmolLM2-135M-Instruct.
        **kwargs: any `EngineArgs` field (dtype, max_model_len,
            enable_extensible_kv_cache, gpu_memory_utilization, ...).

    Raises:
        ValueError / TypeError: invalid engine arguments (unknown names too).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = EngineArgs.__dataclass_fields__
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise TypeError(f"LLM got unknown engine arguments: {', '.join(unknown)}")
        engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` and `chat` use when given none (vLLM's method).

        vLLM's defaults, with the model's generation config's temperature,
        top_p, top_k, min_p and repetition_penalty in their place (unless the
        engine was built with generation_config="vllm").
        """
        diff = self.llm_engine.vllm_config.model_config.get_diff_sampling_param()
        return SamplingParams.from_optional(**diff) if diff else SamplingParams()

    # ---------------------------------------------------------------- generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one or many prompts; outputs in input order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids" (and, for a multimodal model, "multi_modal_data":
        {"image": a PIL image or a list of them}, one
        <|vision_start|><|image_pad|><|vision_end|> in the prompt per image).
        A list of strings / token-id lists / dicts is many prompts. `sampling_params`
        is one for all or one per prompt; None =
        `get_default_sampling_params()`. `priority` (vLLM's): one int per prompt,
        lower scheduled first, for an engine built with scheduling_policy="priority".

        Raises:
            ValueError: an invalid prompt or parameters, a priority list of another
                length, a non-zero priority under the fcfs policy (nothing is run then).
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        request_ids = self._add_requests(prompt_list, params_list,
                                         priority or [0] * len(prompt_list))
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations through the model's chat template.

        `tools` (OpenAI function definitions) and `chat_template_kwargs` (e.g.
        `{"enable_thinking": False}`) are variables of the template; the raw text
        comes back (no tool-call or reasoning parsing: that is the server's).
        `continue_final_message=True` continues the last (assistant) message and needs
        `add_generation_prompt=False` (both true: VLLMValidationError, as transformers).
        A multimodal model takes image content parts: {"type": "image_url",
        "image_url": {"url": "data:...|http(s)://...|file://..."}} or
        {"type": "image_pil", "image_pil": <PIL.Image>}.
        """
        conversations = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages)
        )
        prompts = [
            self.render_chat(
                conv,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(
        self,
        conversation: ChatMessages,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> dict:
        """A conversation as a prompt dict (text + token ids, and its images' as
        "multi_modal_data", with "multi_modal_params": the part each came from, which
        errors about an image name) via the chat template."""
        from vllm.transformers_utils.chat_templates import apply_chat_template

        return apply_chat_template(
            self.get_tokenizer(),
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            mm_processor=self.llm_engine.processor.mm_processor,
        )

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of weights and KV cache (needs enable_sleep_mode=True).

        Level 1 offloads the weights to host memory; level 2 discards them, for a
        caller that reloads or updates weights after waking. The KV cache is
        discarded at both levels, with the prefix cache. Addresses are kept, so
        waking needs no CUDA-graph re-capture.
        """
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back "weights" and/or "kv_cache" (both when tags is None).

        After `sleep(level=2)` the woken weights hold nothing: call
        `reload_weights()` before generating; until then `generate` raises
        EngineSleepingError, as the server refuses requests (`vllm serve`
        reloads from the checkpoint itself). A wake that failed part-way and
        is called again still needs that reload (`LLMEngine.wake_up()` keeps
        returning True until the weights are loaded).

        Raises:
            DeviceMemoryError: no device memory now (names the bytes needed and
                free); what could not be mapped stays asleep; call again later.
        """
        self.llm_engine.wake_up(tags)

    def reload_weights(self) -> None:
        """Reload weights from the checkpoint (after sleep(level=2) and wake_up())."""
        self.llm_engine.reload_weights()

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _as_prompt_list(prompts: Any) -> list:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        prompt_list = list(prompts)
        if not prompt_list:
            raise ValueError("no prompts given")
        return prompt_list

    def _add_requests(self, prompts: list, params_list: list[SamplingParams],
                      priorities: list[int]) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params, priority in zip(prompts, params_list, priorities, strict=True):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params, priority=priority)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        return ids

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids if r in finished]
