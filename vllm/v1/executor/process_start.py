"""How the engine starts its processes (worker ranks, the server's engine core).

    spawn (default)   a fresh interpreter per process: nothing inherited, so neither
                      a CUDA context nor torch's OpenMP pool nor a tokenizer's threads
                      can break the child; the user's main script is NOT imported
                      again in it (`main_module_hidden`), so a script written
                      without an `if __name__ == "__main__":` guard works as it is
    fork              VLLM_WORKER_MULTIPROC_METHOD=fork (vLLM's variable): faster to
                      start; unsafe once this process runs CUDA or thread pools (a
                      forked child that starts OpenMP threads after the parent ran
                      parallel work hangs: seen with this CPU build of torch)

Why hide the main module: `multiprocessing`'s spawn imports the parent's main
script in every child (as `__mp_main__`) so that objects defined there can be
unpickled; a script without the guard then builds another engine in each
child, and those spawn more (vLLM's multiprocessing docs describe the
recursion; vLLM avoids it by forking, which this CPU build cannot afford). The
engine's children need nothing from the user's script: their entry points
and classes are named by module path. A worker class defined in the script
itself (`worker_cls="__main__.MyWorker"`) does need it; then the script is
imported as usual and must have the guard.

Signals: a signal to the process group (Ctrl-C, systemd's stop, `timeout`,
`kill -- -PGID`) reaches every process of the engine at once. Only the
frontend acts on SIGINT/SIGTERM: it drains its requests, then stops its
engine core, which stops its workers. So every child ignores both from its
first instruction (`start` spawns it with them ignored, a disposition that
survives exec; its entry point keeps them so) and a parent stops a child
with `STOP_SIGNAL` (`request_stop`). A child whose parent dies leaves on its
own (each entry point watches its parent pid).

    group SIGTERM --> frontend: drain, then SHUTDOWN --> engine core --> workers
                  +-> engine core, workers: ignored (the frontend decides)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

# What the group's stop requests are; a child ignores them (see above).
GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How a parent asks its child to stop (the engine core leaves its loop and shuts its
# workers down; a worker ends at once). Not SIGTERM: that one belongs to the group.
STOP_SIGNAL = signal.SIGUSR1


def start_method() -> str:
    """"spawn", or "fork" when VLLM_WORKER_MULTIPROC_METHOD asks for it."""
    return envs.VLLM_WORKER_MULTIPROC_METHOD or "spawn"


def start(process: BaseProcess, needs_main: bool = False) -> None:
    """`process.start()`; a spawned child does not import the main script again.

    Args:
        needs_main: the child unpickles something defined in the main script
            (e.g. a worker class in it): import it as `multiprocessing` does.
    """
    with group_signals_ignored():
        if needs_main:
            process.start()
            return
        with main_module_hidden():
            process.start()


def ignore_group_signals() -> None:
    """In a child: SIGINT and SIGTERM are the frontend's to act on (see the module doc)."""
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def request_stop(process: BaseProcess) -> None:
    """Ask a child of this process to stop (`STOP_SIGNAL`); a no-op once it is gone."""
    if process.pid is not None and process.exitcode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STOP_SIGNAL)


@contextlib.contextmanager
def group_signals_ignored() -> Iterator[None]:
    """While a child starts: SIGINT and SIGTERM ignored here, so the child inherits
    SIG_IGN through fork and exec and a Ctrl-C during its interpreter's start-up
    (imports take seconds) is no traceback there. Only the main thread can set
    handlers; elsewhere the child installs them as its first step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in GROUP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, which cannot restore it
                signal.signal(sig, handler)


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """While a process starts: `__main__` shows no file and no spec, so spawn's
    preparation data names no main module for the child to import."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: vars(main)[name] for name in ("__file__", "__spec__") if name in vars(main)}
    try:
        if "__file__" in saved:
            del main.__file__
        main.__spec__ = None
        yield
    finally:
        if "__spec__" in saved:
            main.__spec__ = saved["__spec__"]
        else:
            del main.__spec__
        if "__file__" in saved:
            main.__file__ = saved["__file__"]
