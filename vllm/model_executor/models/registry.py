"""Which class implements an HF architecture.

    config.architectures ["LlamaForCausalLM"] --> models/llama.py: LlamaForCausalLM

Model modules are imported only when resolved. A config without
`architectures` (a GGUF-derived one, for instance) is resolved by its
`model_type`.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module under vllm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
}

# HF model_type -> architecture, for configs that do not list architectures.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}

# Architectures that take images (their processor: vllm/multimodal/processing.py).
MULTIMODAL_ARCHS = frozenset({"Qwen2VLForConditionalGeneration"})


class _ModelRegistry:
    """Maps HF architecture names to model classes (vLLM's `ModelRegistry`)."""

    def get_supported_archs(self) -> list[str]:
        return list(_MODELS)

    def resolve_model_cls(self, architectures: list[str]) -> tuple[type[nn.Module], str]:
        """The class of the first supported name in `architectures`, and that name.

        Raises:
            ValueError: none is supported; the message lists the supported ones.
        """
        for arch in architectures:
            if arch in _MODELS:
                module_name, class_name = _MODELS[arch]
                module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
                return getattr(module, class_name), arch
        raise ValueError(
            f"model architectures {list(architectures)} are not supported; "
            f"supported architectures: {', '.join(self.get_supported_archs())}"
        )


ModelRegistry = _ModelRegistry()


def is_multimodal_config(hf_config: Any) -> bool:
    """Whether the config's architecture takes images (without importing the model)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        architectures = [_MODEL_TYPES.get(getattr(hf_config, "model_type", None), "")]
    return any(arch in MULTIMODAL_ARCHS for arch in architectures)


def get_model_architecture(hf_config: Any) -> tuple[type[nn.Module], str]:
    """(model class, architecture name) for an HF config.

    Raises:
        ValueError: unsupported architecture, or no `architectures` and an
            unknown `model_type`; the message lists what is supported.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"config lists no architectures and model_type {model_type!r} is unknown; "
                f"supported architectures: {', '.join(ModelRegistry.get_supported_archs())}"
            )
        architectures = [_MODEL_TYPES[model_type]]
    return ModelRegistry.resolve_model_cls(architectures)
