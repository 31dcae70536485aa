"""A cache directory for what transformers derives from a GGUF file's metadata.

Converting a GGUF's tokenizer takes ~6.6 s and rebuilding its config ~4.4 s
on a CPU (both parse the whole metadata, vocabulary included); reloading the
saved results takes ~0.3 s. So each is derived once and saved under

    $VLLM_CACHE_ROOT (default ~/.cache/vllm)/gguf/<file stem>-<content key>/<kind>/

The content key hashes the file size, its first and last MiB and the
transformers version: cheap to compute for a multi-GiB file, and a changed
file or converter gets a fresh entry. Entries are written to a temporary
directory and renamed into place, so concurrent processes never read a half
written entry (the loser of a race drops its copy).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import transformers

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

_HASH_CHUNK = 1 << 20  # bytes hashed at each end of the file


def get_cache_root() -> Path:
    """$VLLM_CACHE_ROOT, else ~/.cache/vllm (vLLM's default; see vllm/envs.py)."""
    return Path(envs.VLLM_CACHE_ROOT)


def gguf_content_key(gguf_path: str | os.PathLike) -> str:
    """16 hex digits from the size, first/last MiB and the transformers version."""
    digest = hashlib.sha256()
    size = os.path.getsize(gguf_path)
    digest.update(f"{size}:{transformers.__version__}".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_HASH_CHUNK))
        if size > _HASH_CHUNK:
            f.seek(max(size - _HASH_CHUNK, _HASH_CHUNK))
            digest.update(f.read(_HASH_CHUNK))
    return digest.hexdigest()[:16]


def cached_gguf_derivative(
    gguf_path: str | os.PathLike, kind: str, save: Callable[[Path], None]
) -> Path:
    """The cache directory holding `kind` ("config", "tokenizer") for this GGUF file.

    On a miss, `save(directory)` writes the derived files into a fresh
    directory that is then moved into place.
    """
    gguf_path = Path(gguf_path)
    entry = get_cache_root() / "gguf" / f"{gguf_path.stem}-{gguf_content_key(gguf_path)}"
    target = entry / kind
    if target.is_dir():
        return target
    entry.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=entry))
    try:
        logger.info("Deriving the %s of %s once; caching it in %s", kind, gguf_path, target)
        save(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process won the race; its entry is equivalent.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
