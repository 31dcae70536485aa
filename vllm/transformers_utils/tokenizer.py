"""Tokenizers for local models: an HF directory or a .gguf file.

A GGUF file's tokenizer (vocabulary, merges, special tokens, chat template)
is converted by transformers once and saved with `save_pretrained` in the
GGUF cache (`gguf_cache.py`); later loads read the saved files (~0.3 s instead
of ~6.6 s). Its BOS / EOS tokens and chat template are then set from the
file's own metadata (`gguf_metadata.py`), because what transformers' converter
makes of them has changed between releases: the same file must stop at the
same token everywhere.

`get_tokenizer` loads a tokenizer once per process and hands everyone the same
object (keyed by the resolved path and the loading kwargs).
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vllm.transformers_utils.config import is_gguf
from vllm.transformers_utils.gguf_cache import cached_gguf_derivative
from vllm.transformers_utils.gguf_metadata import get_gguf_tokenizer_metadata

# This process's tokenizers: (resolved path, from_pretrained kwargs) -> the tokenizer.
_TOKENIZERS: dict[tuple[str, str], PreTrainedTokenizerBase] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child gets a fresh lock (a thread of the parent may have held it)."""
    global _TOKENIZERS_LOCK
    _TOKENIZERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_tokenizer(model_or_tokenizer_path: str | Path, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF directory or .gguf file, loaded once per process.

    Every caller in a process with the same path (resolved) and the same kwargs
    gets the same object: the frontend's detokenizer, the structured-output
    backends' builds, the tool and reasoning parsers (a load is ~0.2-0.5 s of
    start-up on 2 CPU cores, and up to three of them ran in one process). Read it
    (encode, decode, attributes); do not change it. A thread that encodes while
    others use it takes its own `copy_tokenizer` (HF fast tokenizers are not
    safe to share between such threads). `load_tokenizer` loads a fresh one.

    Args:
        model_or_tokenizer_path: directory with tokenizer files, or a .gguf file.
        kwargs: passed to `AutoTokenizer.from_pretrained` (e.g. trust_remote_code);
            part of the cache key.

    Raises:
        FileNotFoundError: the path is neither a directory nor a .gguf file.
    """
    key = (str(Path(model_or_tokenizer_path).resolve()), repr(sorted(kwargs.items())))
    with _TOKENIZERS_LOCK:  # a second caller waits for the first one's load
        tokenizer = _TOKENIZERS.get(key)
        if tokenizer is None:
            tokenizer = _TOKENIZERS[key] = load_tokenizer(model_or_tokenizer_path, **kwargs)
        return tokenizer


def copy_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """An independent copy (its own Rust tokenizer) for a thread of its own; ~60 % of
    a load's time for SmolLM2's 49k vocabulary, and no files read."""
    return copy.deepcopy(tokenizer)


def load_tokenizer(model_or_tokenizer_path: str | Path, **kwargs: Any
                   ) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local HF directory or .gguf file (uncached: see
    `get_tokenizer`).

    Raises:
        FileNotFoundError: the path is neither a directory nor a .gguf file.
    """
    path = Path(model_or_tokenizer_path)
    if is_gguf(path):

        def save(directory: Path) -> None:
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(
                directory
            )

        tokenizer = AutoTokenizer.from_pretrained(
            cached_gguf_derivative(path, "tokenizer", save), **kwargs
        )
        _apply_gguf_metadata(tokenizer, path)
        return tokenizer
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path, **kwargs)
    raise FileNotFoundError(
        f"tokenizer {model_or_tokenizer_path!r} not found: expected a directory with tokenizer "
        "files or a .gguf file"
    )


def _apply_gguf_metadata(tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """Make the tokenizer's BOS, EOS and chat template the GGUF file's own."""
    meta = get_gguf_tokenizer_metadata(path)
    vocab = len(tokenizer)
    for attr, token_id in (("bos_token", meta.bos_token_id), ("eos_token", meta.eos_token_id)):
        if (token_id is not None and 0 <= token_id < vocab
                and getattr(tokenizer, f"{attr}_id") != token_id):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    if meta.chat_template:
        tokenizer.chat_template = meta.chat_template


# No Unicode canonical or compatibility composition merges more than this many
# code points into one (the longest canonical decompositions in the Unicode
# data, e.g. U+1F85, have 4), so NFC/NFKC normalisation shrinks a text by at
# most this factor before the model's tokens cover it.
MAX_COMPOSITION_FACTOR = 4


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry).

    Entries are counted in the tokenizer's own alphabet (byte-level BPE: one
    character per byte; SentencePiece: one per character), which covers at
    least as many characters of the text as it does. Added tokens count too.
    """
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(token) for token in tokens if token)


def min_num_tokens(num_chars: int, token_chars: int) -> int:
    """A lower bound on the tokens a text of `num_chars` characters encodes to.

    Each token covers at most `token_chars` characters of the normalised text
    (`max_token_chars`), which is at least `num_chars / MAX_COMPOSITION_FACTOR`
    long, so at least this many tokens are needed. Lets a frontend reject a
    prompt that can never fit `max_model_len` without tokenizing megabytes.
    """
    return num_chars // (token_chars * MAX_COMPOSITION_FACTOR)
