"""POST /tokenize and POST /detokenize (vLLM's extra endpoints), on the tokenizer thread."""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.openai.errors import APIError, validation_error
from vllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing, render_chat
from vllm.sampling_params import validate_token_ids


class OpenAIServingTokenization(OpenAIServing):
    """Text (or a chat conversation) <-> token ids with the served model's tokenizer."""

    def __init__(self, engine_client, models, chat_template: str | None = None,
                 default_chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(engine_client, models)
        self.chat_template = chat_template
        self.default_chat_template_kwargs = default_chat_template_kwargs

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Raises APIError: 404 unknown model, 400 neither or both of prompt / messages."""
        self.models.resolve(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if request.messages is not None:
            rendered = await render_chat(
                self.engine_client,
                [m.model_dump(exclude_none=True) for m in request.messages],
                request_template=request.chat_template,
                server_template=self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools,
                chat_template_kwargs=request.chat_template_kwargs,
                default_chat_template_kwargs=self.default_chat_template_kwargs,
            )
            tokens = list(rendered["prompt_token_ids"])
            if rendered.get("multi_modal_data"):  # counted as the engine counts them
                try:
                    tokens = await self.engine_client.expand_images(rendered)
                except ValueError as e:
                    raise validation_error(e, default="messages") from e
        else:
            try:
                tokens = await self.engine_client.tokenize(
                    request.prompt, add_special_tokens=request.add_special_tokens
                )
            except ValueError as e:
                raise validation_error(e, default="prompt") from e
        token_strs = None
        if request.return_token_strs:
            token_strs = await self.engine_client.convert_ids_to_tokens(tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len,
                                tokens=tokens, token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Raises APIError: 404 unknown model, 400 a token id outside the vocabulary."""
        self.models.resolve(request.model)
        try:
            validate_token_ids(request.tokens, self.vocab_size, what="the", parameter="tokens")
        except ValueError as e:
            raise validation_error(e) from e
        return DetokenizeResponse(prompt=await self.engine_client.detokenize(request.tokens))
