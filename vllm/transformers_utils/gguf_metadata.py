"""A GGUF file's tokenizer metadata (special token ids, chat template), read from the file.

Why not from transformers' converted tokenizer: which token a converted GGUF
tokenizer calls EOS has changed between transformers releases (the bundled
SmolLM2 stopped at `<|im_end|>` with 5.24 and ran past it with 5.17), so the
same file answered differently on two machines. The metadata is the file's own
answer, and `gguf`'s key names (`gguf.Keys.Tokenizer`) say where it is.

Why not `gguf.GGUFReader`: it maps every field and tensor (~5 s for the
135M-parameter bundled file, most of it the 49k-entry vocabulary arrays).
Only the key-value header is needed, and it is walked here in ~0.1 s:

    "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x
        ( key: u64 length + UTF-8 | value type u32 | value )
    value: a scalar (`gguf.GGUFValueType`), a string (u64 length + UTF-8) or an
           array (element type u32 | count u64 | elements)

Source: the GGUF specification, github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf

_T = gguf.GGUFValueType
# struct format per scalar type (without byte order).
_SCALARS = {
    _T.UINT8: "B", _T.INT8: "b", _T.UINT16: "H", _T.INT16: "h", _T.UINT32: "I",
    _T.INT32: "i", _T.FLOAT32: "f", _T.BOOL: "?", _T.UINT64: "Q", _T.INT64: "q",
    _T.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The special tokens and chat template a GGUF file declares (None where absent).

    Attributes:
        bos_token_id, eos_token_id: the vocabulary's BOS / EOS ids.
        eot_token_id: end of turn (e.g. Llama 3's `<|eot_id|>`), when it differs from EOS.
        eom_token_id: end of message (Llama 3.1's `<|eom_id|>`), likewise.
        chat_template: the Jinja chat template.
    """

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    chat_template: str | None = None

    @property
    def stop_token_ids(self) -> list[int]:
        """EOS, then EOT and EOM where declared: every id that ends a generation."""
        ids = [self.eos_token_id, self.eot_token_id, self.eom_token_id]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def generation_config(self) -> dict[str, Any]:
        """The `generation_config.json` equivalent: bos/eos ids (eos a list when several)."""
        config: dict[str, Any] = {}
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        stops = self.stop_token_ids
        if stops:
            config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
        return config


def read_gguf_metadata(path: str | os.PathLike, keys: set[str]) -> dict[str, Any]:
    """The values of `keys` in a GGUF file's key-value header (arrays are skipped).

    Args:
        path: a .gguf file, little- or big-endian, GGUF version 2 or 3.
        keys: metadata keys, e.g. `gguf.Keys.Tokenizer.EOS_ID`.

    Returns:
        key -> int / float / bool / str for each of `keys` present with a scalar
        or string value.

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a truncated header.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _read_header(buf, keys, os.fspath(path))
        except struct.error as e:
            raise ValueError(f"{os.fspath(path)}: truncated GGUF header ({e})") from e


def _read_header(buf: mmap.mmap, keys: set[str], name: str) -> dict[str, Any]:
    if struct.unpack_from("<I", buf, 0)[0] != gguf.GGUF_MAGIC:
        raise ValueError(f"{name} is not a GGUF file (no 'GGUF' magic)")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written big-endian
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version < 2:
        raise ValueError(f"{name}: GGUF version {version} is not supported (2 or 3)")
    _, kv_count = struct.unpack_from(order + "QQ", buf, 8)
    pos = 24
    found: dict[str, Any] = {}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(order + "Q", buf, at)
        return buf[at + 8 : at + 8 + n].decode("utf-8", errors="replace"), at + 8 + n

    def skip(value_type: int, at: int) -> int:
        if value_type == _T.STRING:
            return string(at)[1]
        if value_type == _T.ARRAY:
            elem_type, count = struct.unpack_from(order + "IQ", buf, at)
            at += 12
            if elem_type in _SCALARS:
                return at + count * struct.calcsize(_SCALARS[_T(elem_type)])
            for _ in range(count):
                at = skip(elem_type, at)
            return at
        return at + struct.calcsize(_SCALARS[_T(value_type)])

    for _ in range(kv_count):
        key, pos = string(pos)
        (value_type,) = struct.unpack_from(order + "I", buf, pos)
        pos += 4
        if key in keys and value_type == _T.STRING:
            found[key], pos = string(pos)
        elif key in keys and value_type in _SCALARS:
            found[key] = struct.unpack_from(order + _SCALARS[_T(value_type)], buf, pos)[0]
            pos = skip(value_type, pos)
        else:
            pos = skip(value_type, pos)
        if len(found) == len(keys):
            break
    return found


def get_gguf_tokenizer_metadata(path: str | os.PathLike) -> GGUFTokenizerMetadata:
    """BOS / EOS / EOT / EOM ids and the chat template of a GGUF file (see the module doc).

    Read once per file version (path, size, mtime) and process: the tokenizer,
    the model config and the engine all ask.
    """
    stat = os.stat(path)
    return _tokenizer_metadata(os.fspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _tokenizer_metadata(path: str, size: int, mtime_ns: int) -> GGUFTokenizerMetadata:
    k = gguf.Keys.Tokenizer
    values = read_gguf_metadata(path, {k.BOS_ID, k.EOS_ID, k.EOT_ID, k.EOM_ID, k.CHAT_TEMPLATE})

    def token_id(key: str) -> int | None:
        value = values.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    return GGUFTokenizerMetadata(
        bos_token_id=token_id(k.BOS_ID),
        eos_token_id=token_id(k.EOS_ID),
        eot_token_id=token_id(k.EOT_ID),
        eom_token_id=token_id(k.EOM_ID),
        chat_template=values.get(k.CHAT_TEMPLATE),
    )
