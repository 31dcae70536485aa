"""Build a model on its device and dtype and fill its weights.

get_model(path, hf_config, dtype, device, load_format)
  -> registry: hf_config.architectures -> model class
  -> loader.validate(path)            (fail before building anything big)
  -> model_cls(hf_config) built under `with device, default dtype`
     (parameters are allocated once, where they live, uninitialised)
  -> loader.load_weights(model, path)  (HF safetensors | GGUF | dummy)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader, set_default_torch_dtype
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.model_executor.model_loader.hf_loader import HFModelLoader
from vllm.model_executor.models.registry import get_model_architecture

logger = init_logger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

__all__ = ["LOAD_FORMATS", "BaseModelLoader", "get_model", "get_model_loader"]


def get_model_loader(load_format: str, model_path: str) -> BaseModelLoader:
    """The loader for `load_format`; "auto" picks GGUF for a .gguf path, safetensors otherwise.

    Raises:
        ValueError: an unknown load format (the message lists the supported ones).
    """
    if load_format == "auto":
        load_format = "gguf" if str(model_path).endswith(".gguf") else "safetensors"
    if load_format == "safetensors":
        return HFModelLoader()
    if load_format == "gguf":
        # Imported here so that HF checkpoints load without the gguf package.
        from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader

        return GGUFModelLoader()
    if load_format == "dummy":
        return DummyModelLoader()
    raise ValueError(f"load_format {load_format!r} is not supported; supported: {LOAD_FORMATS}")


def get_model(
    model_path: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> nn.Module:
    """The model for `hf_config`, on `device` in `dtype`, with its weights loaded, in eval mode.

    Args:
        model_path: HF directory or .gguf file (unused with load_format="dummy").
        hf_config: from `vllm.transformers_utils.config.get_hf_config`.
        dtype: parameter and activation dtype (rope tables and norm statistics
            stay float32 internally).
        device: where parameters are allocated.
        load_format: "auto", "safetensors", "gguf" or "dummy".
        tp_rank, tp_size: this rank's place in the tensor-parallel group.

    Raises:
        ValueError: unsupported architecture or load format; checkpoint tensors
            unexpected, missing, of an unsupported type or misshapen (naming
            file and tensor).
        FileNotFoundError: missing weight files (naming directory and file).
    """
    loader = get_model_loader(load_format, model_path)
    model_cls, arch = get_model_architecture(hf_config)
    loader.validate(model_path)
    start = time.perf_counter()
    with set_default_torch_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, tp_rank=tp_rank, tp_size=tp_size)
    loader.load_weights(model, model_path)
    logger.info(
        "Loaded %s (%s, %s) from %s in %.2f s",
        arch,
        dtype,
        device,
        Path(model_path).name if load_format != "dummy" else "random weights",
        time.perf_counter() - start,
    )
    return model.eval()
