"""Weights from an HF model directory: one or several safetensors files.

    model_dir/
      config.json
      model.safetensors                       (single file), or
      model.safetensors.index.json            {"weight_map": {tensor name: shard file}}
      model-00001-of-0000N.safetensors ...

Tensors are memory-mapped by safetensors and copied once, straight into the
parameter (which converts dtype and device in the same copy).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.models.utils import WeightLoadError

INDEX_FILE = "model.safetensors.index.json"


def get_safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of `model_dir`, from its index when it has one.

    Raises:
        FileNotFoundError: naming the directory when it holds no safetensors
            file, or the directory and file when the index names a missing one.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"{model_dir}: {file.name} is listed in {INDEX_FILE} but missing"
                )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no *.safetensors weights (other weight formats are not supported)"
        )
    return files


def safetensors_weights_iterator(
    files: list[Path], sources: dict[str, Path] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of `files`; records each name's file in `sources`."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if sources is not None:
                    sources[name] = file
                yield name, f.get_tensor(name)


class HFModelLoader(BaseModelLoader):
    """load_format "safetensors" (and "auto" for a directory)."""

    def validate(self, model_path: str) -> None:
        get_safetensors_files(model_path)

    def load_weights(self, model: nn.Module, model_path: str) -> set[str]:
        files = get_safetensors_files(model_path)
        sources: dict[str, Path] = {}
        try:
            return model.load_weights(safetensors_weights_iterator(files, sources))
        except WeightLoadError as e:
            raise ValueError(f"{sources.get(e.tensor_name, model_path)}: {e}") from e
        except ValueError as e:
            raise ValueError(f"{model_path}: {e}") from e
