"""`kv_transfer_params`: what a request carries for a KV connector (torch-free).

Keys, as vLLM's NixlConnector and its disaggregation proxy use them:

    to the prefill instance   {"do_remote_decode": true}
    from it / to the decode   {"do_remote_prefill": true, "do_remote_decode": false,
                               "remote_block_ids": [int, ...], "remote_engine_id": str,
                               "remote_host": str, "remote_port": int,
                               "remote_request_id": str,
                               "remote_epoch": int, "remote_expires_at": float}

The last two are this engine's (optional for other producers): the producer's
sleep count when it kept the blocks, and the wall-clock time (seconds since
the epoch) until which it holds them for a reader (its abort timeout).

`check_kv_transfer_params` is the one validation (the frontend calls it, so a
malformed value is a 400 naming `kv_transfer_params`, never a silent recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.exceptions import VLLMValidationError

_REMOTE_KEYS: dict[str, type] = {
    "remote_block_ids": list, "remote_engine_id": str, "remote_host": str,
    "remote_port": int, "remote_request_id": str,
}
_OPTIONAL_REMOTE_KEYS: dict[str, tuple[type, ...]] = {
    "remote_epoch": (int,), "remote_expires_at": (int, float)}
_FLAGS = ("do_remote_decode", "do_remote_prefill")


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode instance reads a prompt's KV: the prefill's blocks and side channel."""

    block_ids: list[int]
    engine_id: str
    host: str
    port: int
    request_id: str
    epoch: int | None = None  # the producer's sleep count when it kept the blocks
    expires_at: float | None = None  # wall clock (s): it frees them then if nobody read


def check_kv_transfer_params(params: Any, kv_connector: str | None) -> None:
    """Raise VLLMValidationError (parameter "kv_transfer_params") unless `params` is usable.

    Args:
        params: the request's value (None: nothing to check).
        kv_connector: the engine's connector name, or None without one.
    """
    if params is None:
        return
    if kv_connector is None:
        _fail("kv_transfer_params needs a server started with --kv-transfer-config "
              "(this one has no KV connector)")
    if not isinstance(params, dict):
        _fail(f"kv_transfer_params must be an object, got {type(params).__name__}")
    known = [*_FLAGS, *_REMOTE_KEYS, *_OPTIONAL_REMOTE_KEYS]
    unknown = sorted(set(params) - set(known))
    if unknown:
        _fail(f"kv_transfer_params has unknown keys {unknown}; supported: {known}")
    for flag in _FLAGS:
        if flag in params and not isinstance(params[flag], bool):
            _fail(f"kv_transfer_params.{flag} must be a boolean, got {params[flag]!r}")
    if params.get("do_remote_prefill"):
        for key, kind in _REMOTE_KEYS.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                _fail(f"kv_transfer_params.{key} must be a {kind.__name__} with "
                      f"do_remote_prefill, got {value!r}")
        if not 0 < params["remote_port"] < 65536:
            _fail(f"kv_transfer_params.remote_port must be a TCP port (1-65535), got "
                  f"{params['remote_port']}")
        for key, kinds in _OPTIONAL_REMOTE_KEYS.items():
            value = params.get(key)
            if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
                _fail(f"kv_transfer_params.{key} must be a number, got {value!r}")
        ids = params["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            _fail("kv_transfer_params.remote_block_ids must be non-negative ints")


def parse_kv_transfer_params(extra_args: dict[str, Any] | None) -> RemotePrefill | None:
    """The remote prefill a (checked) request points at, or None."""
    params = (extra_args or {}).get("kv_transfer_params") or {}
    if not params.get("do_remote_prefill"):
        return None
    return RemotePrefill(
        list(params["remote_block_ids"]), params["remote_engine_id"], params["remote_host"],
        params["remote_port"], params["remote_request_id"], params.get("remote_epoch"),
        params.get("remote_expires_at"),
    )


def _fail(message: str) -> None:
    raise VLLMValidationError(message, parameter="kv_transfer_params")


def check_kv_transfer_request(params: Any, num_prompt_tokens: int, block_size: int, n: int
                              ) -> None:
    """Raise VLLMValidationError (parameter "kv_transfer_params") unless checked `params`
    fit this request: one sequence (n == 1: a transfer moves one prompt's KV to one
    reader), and with do_remote_prefill enough remote blocks for the prompt's KV
    (all but its last token, `block_size` tokens a block, as the producer's blocks)."""
    if not params or not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
        return
    if n != 1:
        _fail(f"kv_transfer_params needs n=1 (one sequence per KV transfer), got n={n}")
    if params.get("do_remote_prefill"):
        needed = -(-(num_prompt_tokens - 1) // block_size)
        have = len(params["remote_block_ids"])
        if have < needed:
            _fail(f"kv_transfer_params.remote_block_ids holds {have} block(s); this prompt's "
                  f"{num_prompt_tokens} tokens need {needed} of {block_size} tokens (params "
                  "from another prompt?)")
