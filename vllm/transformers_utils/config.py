"""HF configs for local model paths (the paths themselves: `model_path.py`).

A model path is either an HF directory (config.json, safetensors, tokenizer
files) or a single .gguf file, whose metadata holds the config and tokenizer
(read through transformers' GGUF support and cached, see `gguf_cache.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from vllm.logger import init_logger
from vllm.transformers_utils.gguf_cache import cached_gguf_derivative
from vllm.transformers_utils.gguf_metadata import get_gguf_tokenizer_metadata
from vllm.transformers_utils.model_path import (  # noqa: F401  (re-exported)
    BUNDLED_MODEL_NAME,
    GENERATION_CONFIG_FILE,
    check_generation_config_path,
    check_model_path,
    get_bundled_model_path,
    is_gguf,
)

logger = init_logger(__name__)

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


def get_hf_config(model: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The HF config of a local model: an HF directory or a .gguf file.

    A GGUF's config is rebuilt by transformers from the metadata once and
    cached; `architectures` is filled in from `model_type` when the metadata
    does not carry it. `trust_remote_code` lets transformers run an HF
    directory's own config class (its `auto_map`), as vLLM's flag does.

    Raises:
        FileNotFoundError: `model` is neither a directory with config.json nor
            a .gguf file (`check_model_path`).
    """
    check_model_path(model)
    path = Path(model)
    if is_gguf(path):
        return _get_gguf_config(path)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


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


def try_get_generation_config(source: str | os.PathLike) -> dict[str, Any]:
    """A model's generation config as a dict; {} when it has none.

    Args:
        source: an HF model directory (its generation_config.json), a
            generation_config.json file, or a .gguf file (the `bos_token_id`
            and `eos_token_id` list from its metadata: EOS, EOT, EOM).

    Raises:
        ValueError: a generation_config.json that is not a JSON object.
    """
    path = Path(source)
    if is_gguf(path):
        return get_gguf_tokenizer_metadata(path).generation_config()
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config
