"""Helpers every model shares: its attention layers, config reading, weight loading."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm.attention.layer import Attention
from vllm.model_executor.layers.weight_utils import default_weight_loader

# (fused parameter fragment, checkpoint fragment, shard id): HF keeps q/k/v and
# gate/up as separate tensors; the models stack them into one matmul.
StackedParamsMapping = list[tuple[str, str, object]]


class WeightLoadError(ValueError):
    """A checkpoint tensor that cannot be loaded; `tensor_name` is its HF name."""

    def __init__(self, message: str, tensor_name: str) -> None:
        super().__init__(message)
        self.tensor_name = tensor_name


def get_attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Every `Attention` in `model`, keyed by its `layer_name` (its prefix), in module order.

    Raises:
        ValueError: two layers share a name (their KV caches would collide).
    """
    layers: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in layers:
                raise ValueError(f"duplicate attention layer name {module.layer_name!r}")
            layers[module.layer_name] = module
    return layers


def get_rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from an HF config of transformers 4.x or 5.x.

    transformers 5 folds theta and scaling into `rope_parameters`; 4.x keeps
    `rope_theta` and `rope_scaling` apart.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {key: value for key, value in params.items() if key != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return float(params["rope_theta"]), scaling
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def get_head_dim(config: Any) -> int:
    """`config.head_dim` where given (Qwen3, some Llamas), else hidden_size / num_heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def load_params(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping,
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load HF-named checkpoint tensors into `model`'s parameters.

    Each name is either mapped onto a stacked parameter (first matching entry
    of `stacked_params_mapping`, fragment replaced, loaded with its shard id)
    or must name a parameter directly. A parameter counts as loaded when
    every id in its `shard_ids` (or its single unsharded tensor) arrived.

    Returns:
        the names of the model parameters loaded (all of them).

    Raises:
        ValueError: a tensor the model has no parameter for (all such names
            listed) or a parameter the checkpoint did not provide (listed).
        WeightLoadError: a shape mismatch (names the checkpoint tensor).
    """
    params = dict(model.named_parameters())
    received: dict[str, set[object]] = {}
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        param_name, shard_id = name, None
        for fused, fragment, sid in stacked_params_mapping:
            if fragment in name:
                param_name, shard_id = name.replace(fragment, fused), sid
                break
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} -> parameter {param_name!r}: {e}", name
            ) from e
        received.setdefault(param_name, set()).add(shard_id)
    missing = _missing_tensors(params, received, stacked_params_mapping)
    if unexpected or missing:
        problems = []
        if unexpected:
            problems.append(f"unexpected tensors (no such parameter): {unexpected}")
        if missing:
            problems.append(f"parameters missing from the checkpoint: {missing}")
        raise ValueError("; ".join(problems))
    return set(received)


def _missing_tensors(
    params: dict[str, nn.Parameter],
    received: dict[str, set[object]],
    stacked_params_mapping: StackedParamsMapping,
) -> list[str]:
    """Checkpoint names (HF naming) of the tensors no parameter received."""
    missing = []
    for name, param in params.items():
        got = received.get(name, set())
        for shard_id in getattr(param, "shard_ids", (None,)):
            if shard_id in got:
                continue
            hf_name = name
            for fused, fragment, sid in stacked_params_mapping:
                if sid == shard_id and fused in name:
                    hf_name = name.replace(fused, fragment)
                    break
            missing.append(hf_name)
    return missing
