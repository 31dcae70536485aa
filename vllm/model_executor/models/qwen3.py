"""Qwen3 (dense): Llama plus a per-head RMSNorm on q and k before rope.

No q/k/v bias by default (`attention_bias`), and `head_dim` is explicit in the
config (it need not equal hidden_size / num_attention_heads).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM


class Qwen3Attention(LlamaAttention):
    """Adds q_norm / k_norm: RMSNorm over head_dim, applied to every head."""

    def build_qk_norm(self, config: PretrainedConfig) -> None:
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads * head_dim], k [T, num_kv_heads * head_dim] -> same shapes."""
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen3 shares Qwen2's config checks (sliding window refused)."""

    model_cls = Qwen3Model
