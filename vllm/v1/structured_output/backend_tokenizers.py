"""The grammar backends' view of the model's tokenizer, built once per process, off the
request path.

```
 engine start-up    GrammarCompiler(...)  --prepare(key)-->  a daemon thread:
 (engine core,      Worker.load_model     --prepare(key)-->    get_tokenizer(path), then
  each worker)                                                 xgrammar's TokenizerInfo
                                                               or llguidance's LLTokenizer
                                                             -> Future[BackendTokenizer]
 a compile (pool)   get(key): the future's result           (waits only if the build
                    is still running: the request stays in WAITING_FOR_FSM meanwhile)
 a worker process   a pickled grammar carries its TokenizerKey (not the 4 MiB tokenizer
                    JSON of a 128k vocabulary) and finds this process's build by it
```

Why: a fresh engine's first structured request used to build these in the compile pool
(tens of milliseconds for a 49k vocabulary, seconds for the benchmark's 128k one:
loading the HF tokenizer again, then the backend's walk over the vocabulary), so it
waited for work that depends on no request. Worker processes rebuilt xgrammar's
TokenizerInfo from JSON for every grammar. Now one build per (backend, tokenizer,
vocabulary, stop ids) and process, started when the engine starts; start-up never
waits for it. A daemon thread (not a pool): an interpreter exiting mid-build (llguidance
takes a minute on a vocabulary of 128k added tokens) does not wait for it.

Rejected: building it synchronously at start-up (every engine would pay seconds for a
feature most requests do not use); shipping the tokenizer JSON with a digest (still
4 MiB pickled per request for a 128k vocabulary).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class TokenizerKey:
    """What a backend's tokenizer is built from (picklable; one build per key and process).

    Attributes:
        backend: "xgrammar" or "guidance" (llguidance).
        path: the tokenizer's path (`get_tokenizer`: an HF directory or a .gguf file).
        vocab_size: the logits' width (tokens; >= the tokenizer's own vocabulary).
        stop_token_ids: sorted EOS ids (the tokenizer's own EOS is added at the build).
    """

    backend: str
    path: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    def for_backend(self, backend: str) -> TokenizerKey:
        return replace(self, backend=backend)


@dataclass(frozen=True)
class BackendTokenizer:
    """One backend's tokenizer for one key.

    Attributes:
        tokenizer: the HF tokenizer (reasoning tags are looked up in it).
        info: `xgrammar.TokenizerInfo` (xgrammar) or `llguidance.LLTokenizer` (guidance).
        stop_token_ids: the key's stop ids and the tokenizer's EOS.
        build_s: seconds the build took (tokenizer load + the backend's vocabulary walk).
    """

    tokenizer: Any
    info: Any
    stop_token_ids: frozenset[int]
    build_s: float


# This process's builds (key -> future); a failed build is retried by the next prepare().
_BUILDS: dict[TokenizerKey, Future[BackendTokenizer]] = {}
_BUILDS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked worker (VLLM_WORKER_MULTIPROC_METHOD=fork) has no build thread: builds in
    flight in the parent would never finish here, so they are forgotten (done ones kept)."""
    global _BUILDS_LOCK
    _BUILDS_LOCK = threading.Lock()
    for key in [k for k, future in _BUILDS.items() if not future.done()]:
        del _BUILDS[key]


os.register_at_fork(after_in_child=_after_fork_in_child)


def prepare(key: TokenizerKey) -> Future[BackendTokenizer]:
    """The build of `key` in this process, started now on a daemon thread unless one is
    already running or done; never waits."""
    with _BUILDS_LOCK:
        future = _BUILDS.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = _BUILDS[key] = Future()
            future.set_running_or_notify_cancel()
            threading.Thread(target=_build_into, args=(key, future), daemon=True,
                             name=f"grammar-tokenizer-{key.backend}").start()
        return future


def get(key: TokenizerKey) -> BackendTokenizer:
    """The built tokenizer of `key` (waits for a build in flight; starts one if none).

    Raises:
        whatever loading the tokenizer or the backend's build raised (OSError for a
        missing tokenizer, ...).
    """
    return prepare(key).result()


def _build_into(key: TokenizerKey, future: Future[BackendTokenizer]) -> None:
    try:
        future.set_result(_build(key))
    except BaseException as e:  # a daemon thread: the error goes to whoever waits
        logger.warning("structured outputs: building %s's tokenizer for %s failed: %s",
                       key.backend, key.path, e)
        future.set_exception(e)


def _build(key: TokenizerKey) -> BackendTokenizer:
    from vllm.transformers_utils.tokenizer import get_tokenizer

    start = time.perf_counter()
    # The sampler applies either backend's masks with xgrammar's kernels
    # (v1/sample/ops/bitmask.py): imported here (~2 s cold), not by the first masked step.
    import xgrammar as xgr

    tokenizer = get_tokenizer(key.path)
    stops = frozenset({*key.stop_token_ids,
                       *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    if key.backend == "guidance":
        # llguidance.torch is the masks' module (GuidanceMatcher): its import loads
        # torch.compile's machinery, ~2 s on the 2-core CPU, which the first compile (and a
        # worker's first grammar, on the step) paid.
        import llguidance.hf
        import llguidance.torch

        info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=key.vocab_size,
                                            eos_token=sorted(stops) or None)
    else:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=key.vocab_size,
                                                  stop_token_ids=sorted(stops))
    build_s = time.perf_counter() - start
    logger.info("structured outputs: %s for %d tokens built in %.2f s, in the background",
                "llguidance's tokenizer" if key.backend == "guidance" else
                "xgrammar's TokenizerInfo", key.vocab_size, build_s)
    return BackendTokenizer(tokenizer, info, stops, build_s)


def built_for(backend: str) -> str:
    """Whose tokenizer an engine's backend builds at start-up: "guidance" (llguidance)
    for "guidance" / "llguidance", else "xgrammar" ("auto" starts with xgrammar)."""
    return "guidance" if backend in ("guidance", "llguidance") else "xgrammar"


def tokenizer_key_for(vllm_config: Any) -> TokenizerKey:
    """The key of the engine's backend (`--structured-outputs-config`; "auto" builds
    xgrammar's, its first choice): the model's tokenizer and vocabulary, and the
    generation config's EOS ids as stop tokens."""
    model_config = vllm_config.model_config
    eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return TokenizerKey(built_for(vllm_config.structured_outputs_config.backend),
                        model_config.tokenizer, model_config.get_vocab_size(),
                        tuple(sorted(set(eos_ids))))


def prepare_for(vllm_config: Any) -> Future[BackendTokenizer]:
    """Start (or find) this process's build for the engine's backend; never waits."""
    return prepare(tokenizer_key_for(vllm_config))
