"""Test helper: tiny random-weight HF checkpoints written on the fly."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tests.model_dirs import TINY_LAYOUT

_COMMON = dict(TINY_LAYOUT, vocab_size=101, intermediate_size=96, max_position_embeddings=128)

# name -> (config class, overrides)
CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3_rope_tied": (
        LlamaConfig,
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": (
        Qwen2Config,
        dict(tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}),
    ),
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=False, head_dim=24)),
}


def make_hf_model(name: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny HF model with weights large enough that attention and rope matter."""
    config_cls, extra = CONFIGS[name]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model


def save_checkpoint(
    model: PreTrainedModel, directory: Path, max_shard_size: str | None = None
) -> Path:
    """save_pretrained as safetensors (sharded with an index when max_shard_size is set)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory
