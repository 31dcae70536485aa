"""`EngineCoreLauncher`: the engine core process, started before its configuration exists.

`vllm serve` calls `prestart_engine_core()` right after its flags and port are
checked: the new process (`core_proc.run_engine_core` with no configuration)
imports torch and the engine while the frontend imports the server and builds
the configuration, the two overlapping on separate cores (~3 s of a ~15 s
start on a 2-core host). `AsyncMPClient` takes the waiting process
(`take_launcher`), binds its sockets and sends the configuration; if the
frontend fails first, `cancel_prestarted_engine_core()` stops it. Offline
`LLM` and every other client start one the same way and send the
configuration at once.

This module imports no torch: it must be cheap to import before the process starts.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import uuid
from typing import TYPE_CHECKING

from vllm.v1.engine.core_proc import run_engine_core
from vllm.v1.executor import process_start

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class EngineCoreLauncher:
    """An engine core process, started before its configuration is sent.

    The process imports the engine's modules at once (a few seconds of CPU),
    so `vllm serve` starts it right after checking its flags and builds the
    configuration meanwhile (`prestart_engine_core`); `AsyncMPClient`
    then takes it over and sends the configuration. Without a prestarted one
    the client starts its own and sends the configuration straight away.

    Attributes: process (the spawned process), status (the read end of its
    status pipe), addresses (the ZMQ ipc addresses of its input and output
    sockets, which the client binds), paths (their socket files).
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        base = os.path.join(tempfile.gettempdir(), f"vllm-core-{uuid.uuid4().hex[:12]}")
        self.paths = [f"{base}-in", f"{base}-out"]
        self.addresses = [f"ipc://{path}" for path in self.paths]
        self.status, child_status = context.Pipe(duplex=False)
        child_config, self._config = context.Pipe(duplex=False)
        self.process = context.Process(
            target=run_engine_core,
            name="EngineCore",
            args=(None, *self.addresses, child_status, os.getpid(), child_config),
            daemon=False,  # it starts the worker processes itself
        )
        process_start.start(self.process)  # a guard-less script is not run again there
        child_status.close()
        child_config.close()

    def send_config(self, vllm_config: VllmConfig) -> None:
        """Hand the process its configuration: it builds the engine from here.

        Raises: OSError (BrokenPipeError) when the process is gone; the pipe is
        closed either way, so a live process never waits for it forever.
        """
        try:
            self._config.send(vllm_config)
        finally:
            self._config.close()

    def cancel(self) -> None:
        """Stop a process that got no configuration (the frontend failed first)."""
        self._config.close()
        self.status.close()
        if self.process.is_alive():
            process_start.request_stop(self.process)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


_prestarted: EngineCoreLauncher | None = None


def prestart_engine_core() -> None:
    """Start the next `AsyncMPClient`'s process now (see `EngineCoreLauncher`)."""
    global _prestarted
    if _prestarted is None:
        _prestarted = EngineCoreLauncher()


def cancel_prestarted_engine_core() -> None:
    """Stop a prestarted process that no client took (a no-op when none is waiting)."""
    global _prestarted
    launcher, _prestarted = _prestarted, None
    if launcher is not None:
        launcher.cancel()


def take_launcher() -> EngineCoreLauncher:
    """The prestarted process if one is waiting and alive, else one started now."""
    global _prestarted
    launcher, _prestarted = _prestarted, None
    if launcher is not None and launcher.process.is_alive():
        return launcher
    if launcher is not None:
        launcher.cancel()
    return EngineCoreLauncher()
