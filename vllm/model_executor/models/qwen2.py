"""Qwen2 (Qwen2, Qwen2.5): Llama with a bias on the q/k/v projections.

Only the attention's bias rule differs from `llama.py`; everything else is
inherited. Sliding-window attention (`use_sliding_window: true`, which no
released Qwen2/2.5 checkpoint enables) is refused at construction.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def o_proj_bias(config: PretrainedConfig) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    decoder_layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"{cls.__name__}: use_sliding_window=True (sliding_window="
                f"{getattr(config, 'sliding_window', None)}) is not supported"
            )
