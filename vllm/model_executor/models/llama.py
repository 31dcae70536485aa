"""Llama (SmolLM2, Llama 3.x) over the paged KV cache; Qwen2 and Qwen3 subclass it.

    input_ids [T] -> embed_tokens -> N x LlamaDecoderLayer -> norm -> hidden [T, hidden]
                                                          compute_logits -> [N, vocab] (model dtype)

    LlamaDecoderLayer (pre-norm, residual stream carried beside the hidden state):
      h, r = input_layernorm(h, r)          # r = h + r; h = rms(r)
      h    = self_attn(positions, h)  # qkv_proj -> (q/k norm) -> rope + KV write -> attn -> o_proj
      h, r = post_attention_layernorm(h, r)
      h    = mlp(h)                         # gate_up_proj -> silu(gate) * up -> down_proj

Tokens of all requests are flattened into T rows; the attention layer reads the
per-step metadata from the forward context, so the forward has no per-request
logic, no host sync and no data-dependent shape (CUDA-graph safe).

Subclasses change one piece by overriding a class attribute:
`LlamaForCausalLM.model_cls`, `LlamaModel.decoder_layer_cls`,
`LlamaDecoderLayer.attention_cls`, and on the attention the `qkv_bias` /
`o_proj_bias` rules and the `qk_norm` hook (with `build_qk_norm` for its modules).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm.attention.layer import Attention
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.fused_linear import act_and_project, norm_and_project
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import (
    StackedParamsMapping,
    get_head_dim,
    get_rope_parameters,
    load_params,
)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: x [T, hidden] -> down(silu(gate(x)) * up(x)) [T, hidden]."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; only 'silu' is")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_gate_up(self.gate_up_proj(x))

    def forward_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * intermediate] (gate_up_proj's output) -> [T, hidden].

        SiLU-and-mul and down_proj are one launch for small CUDA batches
        (`layers/fused_linear.py`).
        """
        return act_and_project(self.act_fn, self.down_proj, gate_up)


class LlamaAttention(nn.Module):
    """Self-attention: hidden [T, hidden] -> [T, hidden], heads split over TP ranks.

    Args:
        config: HF config (hidden_size, num_attention_heads,
            num_key_value_heads, head_dim, attention_bias).
        rotary_emb: the model's rotary embedding (shared by all layers).
        prefix: module path, e.g. "model.layers.3.self_attn"; the attention
            layer is named f"{prefix}.attn".
    """

    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix: str = "",
    ) -> None:
        super().__init__()
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_num_heads,
            total_num_kv_heads,
            bias=self.qkv_bias(config),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        # o_proj reads exactly the heads qkv_proj produced on this rank.
        shard = self.qkv_proj.head_shard
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim,
            config.hidden_size,
            bias=self.o_proj_bias(config),
            tp_rank=tp_rank,
            tp_size=tp_size,
            input_shard=(shard.q_start * self.head_dim, self.q_size),
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=f"{prefix}.attn",
        )
        self.build_qk_norm(config)

    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def o_proj_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def build_qk_norm(self, config: PretrainedConfig) -> None:
        """Hook at the end of `__init__`: create the modules `qk_norm` uses (none for Llama)."""

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook between the projection and rope (identity for Llama)."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.forward_qkv(positions, self.qkv_proj(hidden_states))

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] (qkv_proj's output) -> [T, hidden]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        # The attention layer rotates q and k: on CUDA the rotation and the KV
        # cache write are one launch (one fewer kernel per layer per step).
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block; carries the residual stream beside the hidden state."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(
            config, rotary_emb, tp_rank=tp_rank, tp_size=tp_size, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it), both [T, hidden].

        Each norm runs with the projection after it (`norm_and_project`: one
        launch for small CUDA batches, else the norm then the matmul).
        """
        attn, mlp = self.self_attn, self.mlp
        qkv, new_residual = norm_and_project(
            self.input_layernorm, attn.qkv_proj, hidden_states, residual
        )
        residual = hidden_states if residual is None else new_residual
        hidden_states = attn.forward_qkv(positions, qkv)
        gate_up, residual = norm_and_project(
            self.post_attention_layernorm, mlp.gate_up_proj, hidden_states, residual
        )
        return mlp.forward_gate_up(gate_up), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: input_ids [T] -> hidden [T, hidden]."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix: str = "model",
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        # One rotary module for all layers: its cos/sin cache can be tens of MiB.
        self.rotary_emb = _build_rope(config)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(
                config,
                self.rotary_emb,
                tp_rank=tp_rank,
                tp_size=tp_size,
                prefix=f"{prefix}.layers.{i}",
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """A Llama-architecture causal LM, vLLM's model interface.

    Args:
        config: the HF config (architectures, sizes, rope, tie_word_embeddings).
        tp_rank, tp_size: this rank's place in the tensor-parallel group.
        prefix: prepended to the attention layer names ("" -> "model.layers.{i}.self_attn.attn").

    Parameters are created empty on the current default device and dtype;
    `load_weights` (or the dummy loader) fills them.
    """

    model_cls: type[LlamaModel] = LlamaModel
    stacked_params_mapping: StackedParamsMapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = self.model_cls(
            config,
            tp_rank=tp_rank,
            tp_size=tp_size,
            prefix=f"{prefix}.model" if prefix else "model",
        )
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError for config features this implementation does not have."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden_states [T, hidden] (model dtype)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab_size] in the model's dtype.

        As in vLLM, the sampler (and every other consumer) computes in float32;
        an all-greedy batch needs only the argmax, which the raw logits give
        without a float32 copy ([32, 128256]: 9.4 us on the H200).
        """
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (q/k/v and gate/up stacked here; tied lm_head skipped).

        Returns the loaded parameter names. Raises ValueError naming unexpected,
        missing or misshapen tensors.
        """
        return load_params(self, weights, self.stacked_params_mapping, skip=self._skip_weight)

    def _skip_weight(self, name: str) -> bool:
        # Old checkpoints store the rope frequencies; ours are computed. A tied
        # head reads the embedding, so a stored lm_head copy is redundant.
        return "rotary_emb.inv_freq" in name or (
            self.tie_word_embeddings and name == "lm_head.weight"
        )


def _build_rope(config: PretrainedConfig) -> RotaryEmbedding:
    head_dim = get_head_dim(config)
    theta, scaling = get_rope_parameters(config)
    partial = float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    return get_rope(
        head_dim, int(head_dim * partial), config.max_position_embeddings, theta, scaling
    )
