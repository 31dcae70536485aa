"""The weight-loader protocol shared by every layer.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`
attribute that copies a checkpoint tensor (full, unsharded, HF layout) into
its slice of the parameter, picking this rank's shard. Parameters that stack
several checkpoint tensors (QKV, gate/up) also carry `shard_ids`, the ids the
model's `load_weights` must deliver before the parameter counts as loaded.
"""

from __future__ import annotations

import torch


def check_shape(
    target: torch.Tensor | tuple[int, ...], loaded: torch.Tensor, what: str = ""
) -> None:
    """Raise ValueError naming both shapes unless `loaded` has `target`'s shape."""
    expected = tuple(target.shape) if isinstance(target, torch.Tensor) else tuple(target)
    if expected != tuple(loaded.shape):
        where = f" for {what}" if what else ""
        raise ValueError(
            f"shape mismatch{where}: checkpoint has {tuple(loaded.shape)}, model expects {expected}"
        )


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Copy a whole, replicated tensor (norm weights, biases of row-parallel layers).

    The copy converts dtype and device in one step, so callers need not.

    Raises:
        ValueError: shape mismatch, or a shard id given to an unstacked parameter.
    """
    if shard_id is not None:
        raise ValueError(f"parameter is not stacked; got shard id {shard_id!r}")
    check_shape(param, loaded_weight)
    with torch.no_grad():
        param.copy_(loaded_weight)


def check_rows(loaded: torch.Tensor, dim: int, size: int, what: str = "") -> None:
    """Raise ValueError unless `loaded` (a full tensor) has exactly `size` elements along `dim`."""
    if loaded.dim() <= dim or loaded.shape[dim] != size:
        where = f" for {what}" if what else ""
        raise ValueError(
            f"shape mismatch{where}: checkpoint has {tuple(loaded.shape)}, model expects "
            f"{size} along dim {dim}"
        )


def narrow_to_rank(
    loaded: torch.Tensor, dim: int, size: int, index: int, num_shards: int
) -> torch.Tensor:
    """Shard `index` of `num_shards` equal slices of `loaded` along `dim`.

    Raises:
        ValueError: `loaded` does not have exactly `size * num_shards` elements along `dim`.
    """
    if loaded.dim() <= dim or loaded.shape[dim] != size * num_shards:
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
            f"{size * num_shards} along dim {dim} ({num_shards} shard(s) of {size})"
        )
    return loaded.narrow(dim, index * size, size)
