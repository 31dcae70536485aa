"""Every `VLLM_*` environment variable vLLM reads: declared, parsed and documented here only.

    from vllm import envs
    envs.VLLM_GEMV_PDL      # first access: parsed from os.environ, kept as a module
                            # attribute; later accesses are a plain attribute lookup

Each variable is one `_declare(name, parse, default, doc)` below: the name, the
parser of its text (which raises a one-line ValueError naming the variable, the
value and what is accepted), the value when it is unset, and what it changes
(units, accepted values). docs/environment_variables.md is the same list as a
table; `tests/test_envs.py` keeps the two equal and checks that no other module
of `vllm/` reads a `VLLM_*` variable.

Why parse once and cache: two of these are read on decode hot paths (one GEMV
launch per projection, every attention step); re-reading and re-parsing the
environment there cost more than the flag decides. A cached value is a module
attribute, so after the first access `envs.X` costs what any attribute costs.

    first access of envs.X   module __getattr__ -> parse os.environ["X"] (or the
                             default) -> globals()["X"] = value
    later accesses           globals()["X"] (no __getattr__, no os.environ)
    reset()                  drops every cached value: the next access parses again

Call `reset()` after changing a variable in a process that already read it (tests;
a process that sets variables it was handed after start-up). A child process
reads its own environment afresh. Import only the module (`from vllm import
envs`), never a value (`from vllm.envs import X` would keep a stale copy).

Imports only the standard library: every layer may import it, and it costs nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_PREFIX = "VLLM_"


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, how its text is parsed, its value when unset, what it does.

    `parse(name, text)` returns the value or raises ValueError (one line naming
    the variable, the value and what is accepted). `default` is the value when
    the variable is unset, or set to blank text unless `blank_is_unset` is False
    (an on/off switch set to "" is a typo, not a request for the default); a
    callable default is called each time it is needed (a path under $HOME).
    """

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str
    blank_is_unset: bool = True

    def read(self, environ: Mapping[str, str]) -> Any:
        """The value in `environ` (parsed), or the default.

        Raises:
            ValueError: a malformed value, from `parse`.
        """
        text = environ.get(self.name)
        if text is None or (self.blank_is_unset and not text.strip()):
            return self.default() if callable(self.default) else self.default
        return self.parse(self.name, text)


# ----------------------------------------------------------------------- parsers

_FLAG_VALUES = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


def _flag(name: str, text: str) -> bool:
    """1/true/on or 0/false/off, any case, surrounding spaces ignored."""
    flag = _FLAG_VALUES.get(text.strip().lower())
    if flag is None:
        raise ValueError(f"{name} must be 1/true/on or 0/false/off, got {text.strip()!r}")
    return flag


def _text(name: str, text: str) -> str:
    """The text as given."""
    return text


def _path(name: str, text: str) -> str:
    """A directory; a leading ~ is the home directory."""
    return os.path.expanduser(text.strip())


def _number(minimum: float, strict: bool, what: str) -> Callable[[str, str], float]:
    """A finite float >= minimum (> minimum when strict); `what` ends the error message."""

    def parse(name: str, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not (value > minimum if strict else value >= minimum):
            raise ValueError(f"{name}={text.strip()!r} must be {what}")
        return value

    return parse


def _port(minimum: int) -> Callable[[str, str], int]:
    """A TCP port in [minimum, 65535]."""

    def parse(name: str, text: str) -> int:
        value = text.strip()
        if not (value.isascii() and value.isdigit()) or not minimum <= int(value) <= 65535:
            raise ValueError(f"{name}={value!r} must be a TCP port in {minimum}..65535")
        return int(value)

    return parse


def _cores(name: str, text: str) -> int:
    """A whole number >= 0."""
    value = text.strip()
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{name}={value!r} must be a whole number of cores")
    return int(value)


def _log_level(name: str, text: str) -> str:
    """A `logging` level name, any case; returned upper case."""
    value = text.strip().upper()
    if value not in _LOG_LEVELS:
        raise ValueError(f"{name}={text.strip()!r} must be a logging level: DEBUG, INFO, "
                         "WARNING, ERROR or CRITICAL (any case)")
    return value


def _cpu_binding(name: str, text: str) -> str:
    """The text, stripped. Whether a CPU list fits this process (and names a list for
    every rank) is checked by vllm/platforms/cpu_threads.py, which knows the CPUs."""
    return text.strip()


def _start_method(name: str, text: str) -> str:
    """A worker start method: fork or spawn, any case."""
    value = text.strip().lower()
    if value not in ("fork", "spawn"):
        raise ValueError(f"{name}={text.strip()!r} must be fork or spawn")
    return value


def _default_cache_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm")


# ------------------------------------------------------------------ declarations

_VARIABLES: dict[str, EnvVar] = {}


def _declare(name: str, parse: Callable[[str, str], Any], default: Any, doc: str,
             blank_is_unset: bool = True) -> None:
    assert name.startswith(_PREFIX) and name not in _VARIABLES, name
    _VARIABLES[name] = EnvVar(name, parse, default, " ".join(doc.split()), blank_is_unset)


_declare("VLLM_API_KEY", _text, None, """
    The key `vllm serve` requires as 'Authorization: Bearer <key>' on /v1/* when
    --api-key is not given (unset or blank: no key).""")

_declare("VLLM_LOGGING_LEVEL", _log_level, "INFO", """
    Level of the "vllm" logger: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case),
    as in Python's `logging`.""")

_declare("VLLM_CONFIGURE_LOGGING", _flag, True, """
    1/true/on: vllm's log lines go to stdout with vLLM's format. 0/false/off: no
    handler is added, so the application's own logging configuration decides (the
    level of VLLM_LOGGING_LEVEL still applies).""")

_declare("VLLM_CACHE_ROOT", _path, _default_cache_root, """
    Directory of vLLM's on-disk caches (a leading ~ is the home directory); what
    transformers derives from a GGUF file (tokenizer, config) is kept under
    <root>/gguf/. Default ~/.cache/vllm.""")

_declare("VLLM_PORT", _port(1), None, """
    TCP port (1..65535) of the ranks' torch.distributed rendezvous on rank 0's node
    (`mp` and `ray` executors), so a firewall can be opened for it. Unset: a port free
    at start-up.""")

_declare("VLLM_WORKER_STARTUP_TIMEOUT", _number(0, True, "a number of seconds > 0"), 300.0, """
    Seconds the `mp` executor waits for every worker process to start and build its
    worker object (imports, no model yet) before it fails naming the rank.""")

_declare("VLLM_WORKER_MULTIPROC_METHOD", _start_method, None, """
    How the `mp` executor starts its worker processes: spawn or fork (vLLM's
    variable). Unset: spawn, a fresh interpreter that does not import the user's main
    script again (a script without an `if __name__ == "__main__":` guard works). fork
    starts faster but is unsafe once the process runs CUDA or thread pools.""")

_declare("VLLM_RAY_PG_TIMEOUT", _number(0, True, "a number of seconds > 0"), 120.0, """
    Seconds the `ray` executor waits for the cluster to grant its placement group
    (one bundle per rank); then start-up fails saying what the cluster has.""")

_declare("VLLM_CPU_KVCACHE_SPACE", _number(0, False, "a non-negative number of GiB"), 0.0, """
    KV cache budget on the CPU platform, in GiB (fractions allowed). 0 or unset: the
    default, min(4 GiB, memory available at start-up), as in vLLM.""")

_declare("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding, "auto", """
    Compute threads on the CPU platform, as in vLLM. "auto": one thread per physical
    core the process may use, on the first NUMA node that has such cores, bound to
    those cores, less VLLM_CPU_NUM_OF_RESERVED_CPU; with that unset, as many of them
    compute as other processes leave idle (read between steps, once a second).
    "nobind": the thread count is torch's (OMP_NUM_THREADS, else one per core) and
    nothing is bound. A CPU list
    such as "0-3,8" (rank i of "0-3|4-7" takes list i): one thread per listed CPU,
    bound to them; a list naming CPUs the process may not use is an error.""")

_declare("VLLM_CPU_NUM_OF_RESERVED_CPU", _cores, None, """
    Physical cores kept free of compute threads under VLLM_CPU_OMP_THREADS_BIND=auto,
    a whole number >= 0 (vLLM reserves 1 for its frontend). Unset: none reserved up
    front; the compute threads follow the cores other processes leave idle instead.""")

_declare("VLLM_GEMV_PDL", _flag, True, """
    1/true/on: one-row GEMV launches of weights up to 8 MiB use programmatic
    dependent launch on NVIDIA sm_90+ (each fetches its first weight tile while the
    kernel before it finishes). 0/false/off: plain launches. Any other value, blank
    included, is an error.""", blank_is_unset=False)

_declare("VLLM_FRESH_PREFILL_ATTENTION", _flag, True, """
    1/true/on: on sm_90+ a step of fresh prompts (no cached context, at least 128
    tokens) reads its own key/value rows by TMA (`prefill_attention`). 0/false/off:
    the paged kernel runs every prefill. Any other value, blank included, is an
    error.""", blank_is_unset=False)

_declare("VLLM_ELASTIC_KV_SHRINK_DELAY_S", _number(0, False, "a number of seconds >= 0"), 10.0,
         """
    With --enable-elastic-kv-cache: seconds about a chunk of memory must stay spare (the
    blocks in use would fit below it with the low-water mark free) before it is released;
    the blocks still in use there move below it (0: as soon as it is spare).""")

_declare("VLLM_ELASTIC_KV_SHARING", _flag, True, """
    With --enable-elastic-kv-cache: 1/true/on: the engine joins its device's registry of
    elastic engines (what `vllm kv-top` reads), asks the others for memory when it cannot
    grow and releases reclaimable blocks when another asks. 0/false/off: it does neither
    (timed idle release only). Any other value, blank included, is an error.""",
         blank_is_unset=False)

_declare("VLLM_EMULATED_DEVICE_GIB", _number(0, True, "a number of GiB > 0"), None, """
    The device's size for sizing, in GiB, where another process holds the rest of its
    memory (benchmarks/benchmark_elastic.py --device-gib: a ballast): what
    --gpu-memory-utilization and the elastic KV cache's headroom (2 %) are shares of.
    Free memory is read as it is. Unset, or not below the device's: the device's own.""")

_declare("VLLM_KV_REGISTRY_DIR", _path, None, """
    Directory of the per-device registry files of elastic engines (vllm-kv-<device>).
    Default /dev/shm where it exists, else the temp directory. Engines share a device's
    registry only when they use the same directory. One that is missing or not writable:
    an engine serves without the registry (one warning naming it); missing or not
    readable: `vllm kv-top` exits 2 naming it.""")

_declare("VLLM_NIXL_SIDE_CHANNEL_HOST", _text, "127.0.0.1", """
    Address the NixlConnector producer's handshake socket (ZMQ REP) listens on when
    kv_connector_extra_config has no side_channel_host.""")

_declare("VLLM_NIXL_SIDE_CHANNEL_PORT", _port(0), 0, """
    Port of that socket when kv_connector_extra_config has no side_channel_port
    (0: a free port).""")

_declare("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", _number(0, True, "a number of seconds > 0"), 120.0,
         """
    Seconds a NixlConnector producer keeps the blocks of a finished prompt that no
    decode instance read before it frees them, when kv_connector_extra_config has no
    abort_timeout_s (vLLM's default is 480).""")


_declare("VLLM_IMAGE_FETCH_TIMEOUT", _number(0, True, "a number of seconds > 0"), 5.0, """
    Seconds an http(s) image URL of a chat request may take to arrive (vLLM's
    variable); a slower one is a 400 naming the content part.""")

_declare("VLLM_MAX_IMAGE_BYTES", _number(1, False, "a number of bytes >= 1"), 20 * 2**20, """
    Largest encoded image (bytes) a request may bring, as a data: URI, file or http(s)
    download (default 20 MiB); a larger one is a 400 naming the content part.""")


# ------------------------------------------------------------------------ access


def __getattr__(name: str) -> Any:
    """`envs.NAME`: parsed on first access, then kept as a module attribute.

    Raises:
        AttributeError: `name` is not a declared variable.
        ValueError: its value is malformed (one line naming it).
    """
    var = _VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = var.read(os.environ)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_VARIABLES})


def reset() -> None:
    """Forget every parsed value: the next access of each reads os.environ again."""
    module = globals()
    for name in _VARIABLES:
        module.pop(name, None)


def variables() -> tuple[EnvVar, ...]:
    """Every declared variable, in declaration order (for docs and tests)."""
    return tuple(_VARIABLES.values())


def validate() -> None:
    """Parse every variable now (a malformed one fails at start-up, not at first use).

    Raises:
        ValueError: the first malformed variable, in one line naming it.
    """
    for name in _VARIABLES:
        if name not in globals():
            __getattr__(name)


def vllm_environ() -> dict[str, str]:
    """The `VLLM_*` variables set in os.environ now, as text, declared or not (a test
    may pass its own): what a process started elsewhere (a Ray actor) must be given."""
    return {key: value for key, value in os.environ.items() if key.startswith(_PREFIX)}
