"""`EngineCoreProc`: the engine core in its own process, fed and drained over ZMQ.

```
 frontend process (AsyncLLM)                 engine core process (this module)
 ---------------------------                 ---------------------------------
 AsyncMPClient                                input thread:  PULL -> unpickle -> queue
   PUSH  (EngineCoreRequestType ...)  ---->  main thread:   THE STEP LOOP (run)
   PULL  <---- (EngineCoreReplyType ...)  --  output thread: queue -> pickle -> PUSH
   status pipe <-- ready / startup_failed / dead (lifecycle, read by a monitor thread)
```

Why a process: the step loop, the scheduler and the executor no longer share
a GIL with HTTP parsing, tokenization and detokenization, so a slow client or
a huge prompt in the frontend never delays a decode step. Why threads for the
sockets: pickling and socket I/O overlap the model step instead of following it.

The loop (`run`) applies what arrived, steps while there is work, and blocks on
its input when idle. What a failed step means is `faults.py`'s policy: the
step's requests fail (the frontend gets their ids and the message) and the
loop goes on, or the engine is dead: "dead" with the reason goes to the
status pipe, the executor is shut down (no worker is left holding memory) and
the process exits 1. The process ignores SIGINT and SIGTERM (a signal to the
process group reaches it too; the frontend drains, then stops it:
`process_start`), stops on `STOP_SIGNAL` or a SHUTDOWN message, and exits
by itself when the frontend process is gone.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from vllm.exceptions import DeviceBusyError
from vllm.logger import init_logger
from vllm.v1.engine.exceptions import startup_cause, startup_exit_code
from vllm.v1.engine.faults import StepFailures
from vllm.v1.engine.protocol import (
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreReplyType,
    EngineCoreRequestType,
)
from vllm.v1.executor import process_start
from vllm.v1.executor.worker_wrapper import RemoteFailure, WorkerDiedError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Idle: how long the main loop waits for input before looking again (seconds).
# The elastic cache's idle release is looked at once per wait.
_IDLE_POLL_S = 1.0
# Requests wait only for background work (a KV load) or blocks (the last step
# scheduled nothing): the loop waits this long for input between steps instead
# of spinning (seconds). A load finished in the background is picked up within it.
_BACKGROUND_POLL_S = 0.001
# Only finished requests' blocks wait for a transfer (a prefill instance's blocks
# for their reader): they are freed within this long of the reader's notification.
_TRANSFER_POLL_S = 0.01
# How often the process checks that the frontend still exists (seconds).
_PARENT_POLL_S = 1.0
# An input message that is not a request: the executor reported a dead worker.
_EXECUTOR_FAILED = "executor_failed"


class EngineCoreProc:
    """Runs an `EngineCore` behind ZMQ sockets (see the module docstring).

    Args:
        vllm_config: the validated configuration (built in the frontend).
        input_address, output_address: ZMQ endpoints the frontend bound.
    """

    def __init__(self, vllm_config: VllmConfig, input_address: str, output_address: str) -> None:
        import zmq

        from vllm.v1.engine.core import EngineCore

        self.core = EngineCore(vllm_config)
        self._inputs: queue.Queue = queue.Queue()
        self._outputs: queue.Queue = queue.Queue()
        self._failures = StepFailures()
        self.dead_reason: str | None = None
        self._zmq = zmq.Context()
        self.core.model_executor.register_failure_callback(
            lambda e: self._inputs.put((_EXECUTOR_FAILED, e)))
        threading.Thread(
            target=self._read_input, args=(input_address,), name="core-input", daemon=True
        ).start()
        self._writer = threading.Thread(
            target=self._write_output, args=(output_address,), name="core-output", daemon=True
        )
        self._writer.start()

    def ready_info(self) -> dict[str, Any]:
        """What the frontend learns at start-up (the plan, first statistics)."""
        return {
            "plan": self.core.plan,
            "num_blocks": self.core.num_blocks,
            "max_model_len": self.core.max_model_len,
            "scheduler_stats": self.core.get_stats(),
            "kv_memory": self.core.kv_cache_memory(),
        }

    # ---------------------------------------------------------------- sockets
    def _read_input(self, address: str) -> None:
        import zmq

        socket = self._zmq.socket(zmq.PULL)
        socket.connect(address)
        try:
            while True:
                self._inputs.put(pickle.loads(socket.recv()))
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=0)

    def _write_output(self, address: str) -> None:
        import zmq

        socket = self._zmq.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while True:
                message = self._outputs.get()
                if message is None:
                    break
                socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
        finally:
            socket.close(linger=1000)  # let the last messages (shutdown replies) leave

    def _send_outputs(self, outputs: list | None = None, **fields: Any) -> None:
        """One `EngineCoreOutputs` batch with the figures as they are now."""
        core = self.core
        batch = EngineCoreOutputs(outputs=outputs or [], scheduler_stats=core.get_stats(),
                                  kv_memory=core.kv_cache_memory(), **fields)
        self._outputs.put((EngineCoreReplyType.OUTPUTS, batch))

    # -------------------------------------------------------------- main loop
    def run(self) -> str | None:
        """Serve until SHUTDOWN (returns None) or death (returns the reason)."""
        core = self.core
        while True:
            busy = core.has_unfinished_requests()
            if busy and not core.waits_on_background_work():
                timeout = 0.0
            elif busy:
                timeout = _BACKGROUND_POLL_S
            elif core.has_pending_kv_transfers():
                timeout = _TRANSFER_POLL_S
            else:
                timeout = core.idle_poll_s or _IDLE_POLL_S
            if not self._drain_inputs(timeout):
                return self.dead_reason
            if not busy and core.adjust_kv_cache():  # shrinks, or answers a peer, while idle
                self._send_outputs()
            if core.has_unfinished_requests() or core.has_pending_kv_transfers():
                self._step()
                if self.dead_reason is not None:
                    return self.dead_reason

    def _drain_inputs(self, timeout: float) -> bool:
        """Apply every queued input, waiting up to `timeout` s for the first; False when
        the loop must end."""
        try:
            message = self._inputs.get(timeout=timeout) if timeout else self._inputs.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._handle(*message):
                return False
            try:
                message = self._inputs.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: EngineCoreRequestType | str, payload: Any) -> bool:
        core = self.core
        if kind is EngineCoreRequestType.ADD:
            try:
                core.add_request(payload)
            except Exception as e:  # the frontend validated it; report, do not die
                self._send_outputs(failed=[payload.request_id],
                                   error=f"the engine refused the request: {e}")
        elif kind is EngineCoreRequestType.ABORT:
            core.abort_requests(payload)
            self._send_outputs()  # an abort can leave the engine idle: the freed blocks
        elif kind is EngineCoreRequestType.FINISH_STOPPED:
            core.finish_requests_stopped(payload)
            self._send_outputs()
        elif kind is EngineCoreRequestType.UTILITY:
            self._call(*payload)
        elif kind == _EXECUTOR_FAILED:
            self.dead_reason = f"the executor failed: {payload}"
            return False
        elif kind is EngineCoreRequestType.SHUTDOWN:
            return False
        else:
            logger.error("engine core: unknown message %r", kind)
        return True

    def _call(self, call_id: int, method: str, args: tuple) -> None:
        """Run an `EngineCoreUtilities` method; its figures follow before its result."""
        try:
            if method not in UTILITY_METHODS:
                raise ValueError(f"{method!r} is not an engine core utility method")
            reply = (call_id, True, getattr(self.core, method)(*args))
        except Exception as e:
            reply = (call_id, False, RemoteFailure.capture(e))
        # Sleep frees blocks, a wake or a limit changes the cache: the frontend's
        # figures (/metrics) follow now, not at the next step.
        self._send_outputs()
        self._outputs.put((EngineCoreReplyType.RESULT, reply))

    def _step(self) -> None:
        core = self.core
        try:
            outputs = core.step()
        except Exception as e:
            self._step_failed(e)
            return
        self._failures.succeeded()
        self._send_outputs(outputs)

    def _step_failed(self, error: Exception) -> None:
        """Fail the step's requests, or mark the engine dead (faults.py decides)."""
        executor_failed = self.core.model_executor.is_failed
        dead = self._failures.failed(error, executor_failed=executor_failed)
        if dead is not None:
            if executor_failed or isinstance(error, WorkerDiedError):
                logger.error("engine step failed: %s; the engine is dead", error)  # says all
            else:
                logger.exception("engine step failed unrecoverably; the engine is dead")
            self.dead_reason = dead
            return
        failed = self.core.scheduled_request_ids()
        logger.exception("engine step failed; failing its %d request(s)", len(failed))
        try:
            self.core.abort_requests(failed)
        except Exception:
            logger.exception("aborting the failed requests raised")
        self._send_outputs(failed=failed, error=f"the engine step failed: {error!r}")

    def shutdown(self) -> None:
        """Stop the sockets' threads and the core (its executor's workers are reaped)."""
        self._outputs.put(None)
        self._writer.join(5)
        try:
            self.core.shutdown()
        finally:
            self._zmq.term()


# --------------------------------------------------------------- process entry
# What an engine core imports before it can build anything (~3 s on a 2-core
# host); a process started ahead of its configuration imports them while the
# frontend is still building that configuration.
_PRELOAD_MODULES = ("torch", "vllm.config", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
                    "vllm.model_executor.model_loader")


def run_engine_core(
    vllm_config: VllmConfig | None,
    input_address: str,
    output_address: str,
    status: Connection,
    parent_pid: int,
    config_pipe: Connection | None = None,
) -> None:
    """The engine core process: build the core, report ready (or why not), serve.

    With `vllm_config` None the process was started before the frontend had
    a configuration (`core_launcher.EngineCoreLauncher`): it imports the
    engine's modules, then waits for the configuration on `config_pipe`, and
    exits quietly (status 0) if the frontend closes the pipe instead.
    """
    try:
        _run_engine_core(vllm_config, input_address, output_address, status, parent_pid,
                         config_pipe)
    finally:
        # Leaving (any way): a stop request from here on, while the interpreter runs its
        # atexit hooks, ends the process quietly instead of raising SystemExit inside one
        # of them (a traceback on the frontend's stderr: the frontend cancels a prestarted
        # process just as it sees the closed pipe and returns).
        signal.signal(process_start.STOP_SIGNAL, signal.SIG_DFL)


def _run_engine_core(
    vllm_config: VllmConfig | None,
    input_address: str,
    output_address: str,
    status: Connection,
    parent_pid: int,
    config_pipe: Connection | None,
) -> None:
    from vllm.logger import set_process_label

    set_process_label(f"engine core pid {os.getpid()}")
    process_start.ignore_group_signals()
    signal.signal(process_start.STOP_SIGNAL, _raise_system_exit)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if vllm_config is None:
        import importlib

        for name in _PRELOAD_MODULES:
            importlib.import_module(name)
        try:
            vllm_config = config_pipe.recv()
        except (EOFError, OSError):
            return  # the frontend stopped before it had a configuration to send
        finally:
            config_pipe.close()

    from vllm.platforms import current_platform

    # The frontend is this engine, not another process sharing the device: a
    # CUDA context it holds must not make the worker refuse to start.
    current_platform.register_engine_pid(parent_pid)
    try:
        proc = EngineCoreProc(vllm_config, input_address, output_address)
    except BaseException as e:
        _report_startup_failure(status, e)
        # Stopped by the frontend (it was interrupted): quietly; else a failure.
        raise SystemExit(0 if isinstance(e, SystemExit) else 1) from None
    _send(status, ("ready", proc.ready_info()))
    reason = None
    try:
        reason = proc.run()
    except BaseException as e:  # SystemExit from STOP_SIGNAL, or a bug in the loop
        if not isinstance(e, SystemExit):
            logger.exception("the engine core loop crashed")
            reason = f"the engine core loop crashed: {e!r}"
    finally:
        if reason is not None:
            _send(status, ("dead", reason))
        try:
            proc.shutdown()
        except Exception:
            logger.exception("engine core shutdown raised")
    if reason is not None:
        raise SystemExit(1)


def _report_startup_failure(status: Connection, error: BaseException) -> None:
    """Log why the core could not start (one line for a known cause, none when the
    frontend stopped it) and tell the frontend over the status pipe.

    A known cause that a rank in a process of its own raised (a `WorkerError`, which
    does not pickle) is sent as that rank's exception, so the frontend prints it in
    one line as it does with one rank (`startup_errors`)."""
    cause = startup_cause(error)
    if startup_exit_code(cause) is not None or isinstance(cause, DeviceBusyError):
        # The configuration or the device says why: the frontend prints it as one line.
        logger.error("engine core start-up failed: %s", cause)
        error = cause
    elif not isinstance(error, SystemExit):
        logger.exception("engine core start-up failed")
    _send(status, ("startup_failed", RemoteFailure.capture(error)))


def _send(conn: Connection, message: Any) -> None:
    try:
        conn.send(message)
    except Exception:
        logger.debug("status pipe closed", exc_info=True)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """Leave when the frontend is gone (re-parented); workers follow us the same way."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)
