"""`MultiprocExecutor`: one worker process per rank on this node, over pipes.

    engine process                               worker processes (spawned)
    --------------                               --------------------------
    collective_rpc --pickle once, send_bytes--> rank 0: recv -> worker.method() -> reply
                   ----------------------------> rank 1: recv -> worker.method() -> reply
    wait(pipes + process sentinels) <-----------  (seq, ok, result | RemoteFailure)
    monitor thread: wait(sentinels) -> a rank died -> failure callbacks (engine reports it)

How a worker process starts (process_start.py): spawned, a fresh interpreter
that does not import the user's main script again, so a script without an
`if __name__ == "__main__":` guard works (VLLM_WORKER_MULTIPROC_METHOD=fork
forks instead).

Why pipes and sentinels: `multiprocessing.connection.wait` blocks on the
reply pipes and the processes' exit sentinels together, so a rank that dies
mid-call is noticed at once (no polling, no hang), and a monitor thread that
waits on the sentinels alone notices a death between calls.

No zombies, no orphans: `shutdown` (also run at interpreter exit and when the
executor is garbage-collected) asks each worker to stop, then terminates and
finally kills what is left, and joins (reaps) every process. Workers ignore
SIGINT and SIGTERM (a signal to the process group reaches them too; the
frontend decides how to stop: `process_start`), end on `STOP_SIGNAL`, and
exit by themselves when the engine process is gone (their parent pid
changes), even in the middle of a collective.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from vllm import envs
from vllm.distributed.utils import get_distributed_init_method, get_open_port
from vllm.logger import init_logger
from vllm.v1.executor import process_start
from vllm.v1.executor.abstract import Executor, first_error
from vllm.v1.executor.worker_wrapper import (
    RemoteFailure,
    WorkerCall,
    WorkerDiedError,
    WorkerWrapper,
)

logger = init_logger(__name__)

_SHUTDOWN = "shutdown"
# Seconds a worker gets to leave after the shutdown message, then after STOP_SIGNAL.
_SHUTDOWN_GRACE_S = 5.0
_TERMINATE_GRACE_S = 2.0
# How often a worker checks that the engine process still exists (seconds).
_PARENT_POLL_S = 1.0
# After one rank failed a call: how long the others get to answer before the
# executor counts them as stuck in a collective the failed rank never joined.
ERROR_GRACE_S = 5.0
# How long to wait for a worker whose pipe closed to be reaped, so its exit code (or
# signal) can be named: the pipe closes before the process is gone.
_EXIT_WAIT_S = 5.0


@dataclass
class _WorkerHandle:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    pid: int | None = None
    reap_lock: threading.Lock = field(default_factory=threading.Lock)

    def join(self, timeout: float | None) -> int | None:
        """Wait up to `timeout` s for the process to exit; its exit code, or None."""
        return reap(self.process, self.reap_lock, timeout)

    def exit_detail(self) -> str:
        """How the process ended ('killed by SIGKILL', ...), once it is reaped."""
        return describe_exit(self.join(_EXIT_WAIT_S))


def reap(process: multiprocessing.process.BaseProcess, lock: threading.Lock,
         timeout: float | None) -> int | None:
    """`process.join(timeout)` then its exit code (None while it runs), under `lock`.

    multiprocessing's `Popen.poll` is not thread-safe: when two threads reap the same
    child, the loser's `waitpid` fails with ECHILD and `exitcode` reads None, so a
    SIGKILLed worker was reported as "died (still running)" (a monitor thread and the
    thread of a call both wake on its sentinel). Every thread that joins, polls or
    reads `exitcode` of a process must go through here with the same lock.
    """
    with lock:
        process.join(timeout)
        return process.exitcode


def describe_exit(exitcode: int | None) -> str:
    """'exit code 1', 'killed by SIGKILL', or 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class MultiprocExecutor(Executor):
    """One process per rank; ranks meet over torch.distributed at `init_device`."""

    def _init_executor(self) -> None:
        self._rpc_lock = threading.Lock()
        self._seq = 0
        self._shutting_down = False
        self.workers: list[_WorkerHandle] = []
        self.start_method = process_start.start_method()
        context = multiprocessing.get_context(self.start_method)
        init_method = get_distributed_init_method("127.0.0.1", get_open_port())
        self._stop_grace = [_SHUTDOWN_GRACE_S]
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._stop_grace)
        try:
            for rank in range(self.world_size):
                self.workers.append(self._start_worker(context, rank, init_method))
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(
            target=self._monitor_workers, name="vllm-worker-monitor", daemon=True
        )
        self._monitor.start()
        logger.info(
            "Started %d worker processes (%s; pids %s)",
            self.world_size,
            self.start_method,
            ", ".join(str(w.pid) for w in self.workers),
        )

    def _start_worker(self, context: Any, rank: int, init_method: str) -> _WorkerHandle:
        parent_conn, child_conn = context.Pipe(duplex=True)
        kwargs = {
            "vllm_config": self.vllm_config,
            "local_rank": rank,  # one node: rank r drives device r
            "rank": rank,
            "distributed_init_method": init_method,
            "is_driver_worker": rank == 0,
        }
        process = context.Process(
            target=worker_main,
            name=f"VllmWorker-{rank}",
            args=(rank, self.worker_cls, kwargs, child_conn, os.getpid()),
            daemon=True,
        )
        # A worker class defined in the user's script needs the script in the child.
        process_start.start(process, needs_main=self.worker_cls.startswith("__main__."))
        child_conn.close()  # the child holds its end; EOF here means it is gone
        return _WorkerHandle(rank, process, parent_conn)

    def _wait_ready(self) -> None:
        """Each worker reports ("ready", pid) once its worker object exists, or its failure."""
        # How long the workers may take to build their worker objects (imports, no model).
        timeout_s = envs.VLLM_WORKER_STARTUP_TIMEOUT
        deadline = time.monotonic() + timeout_s
        errors: dict[int, BaseException] = {}
        for handle in self.workers:
            remaining = max(deadline - time.monotonic(), 0)
            ready = wait([handle.conn, handle.process.sentinel], timeout=remaining)
            if handle.conn in ready or handle.conn.poll():
                try:
                    status, value = pickle.loads(handle.conn.recv_bytes())
                except (EOFError, OSError):
                    status, value = "died", None
                if status == "ready":
                    handle.pid = value
                    continue
                if status == "failed":
                    errors[handle.rank] = value.to_error(handle.rank, "start-up")
                    continue
            if not ready:
                errors[handle.rank] = TimeoutError(
                    f"worker rank {handle.rank} did not start within {timeout_s:.0f} s"
                )
                continue
            errors[handle.rank] = WorkerDiedError(
                handle.rank, f"{handle.exit_detail()} during start-up"
            )
        if errors:
            raise first_error(errors)

    # ------------------------------------------------------------------ calls
    def _collective_rpc(self, call: WorkerCall) -> list[Any]:
        with self._rpc_lock:
            self.check_health()
            if self._shutting_down:
                raise RuntimeError(f"the executor is shut down; cannot call {call.name}")
            self._seq += 1
            seq = self._seq
            message = (seq, call)
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            for handle in self.workers:
                # A dead rank's pipe is broken; its sentinel fires below, naming it.
                with contextlib.suppress(BrokenPipeError, OSError):
                    handle.conn.send_bytes(payload)
            results = self._gather(seq, call.name, call.timeout)
        return call.replies([results[rank] for rank in range(self.world_size)])

    def _gather(self, seq: int, name: str, timeout: float | None) -> dict[int, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {handle.rank: handle for handle in self.workers}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        while pending:
            if errors:  # the others may wait in a collective the failed rank never joins
                grace = time.monotonic() + ERROR_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
            waitables = [h.conn for h in pending.values()]
            waitables += [h.process.sentinel for h in pending.values()]
            ready = wait(waitables, timeout=remaining)
            if not ready:
                if errors:
                    error = first_error(errors)
                    self._report_failure(error)  # the ranks are out of step for good
                    raise error
                raise TimeoutError(
                    f"{name} did not finish within {timeout} s on rank(s) {sorted(pending)}"
                )
            for handle in list(pending.values()):
                reply = self._read_reply(handle, ready)
                if reply is None:
                    continue
                if isinstance(reply, WorkerDiedError):
                    self._report_failure(reply)
                    raise reply
                reply_seq, ok, value = reply
                if reply_seq != seq:
                    continue  # the late reply of a call that timed out
                del pending[handle.rank]
                if ok:
                    results[handle.rank] = value
                else:
                    errors[handle.rank] = value.to_error(handle.rank, name)
        if errors:
            raise first_error(errors)
        return results

    @staticmethod
    def _read_reply(handle: _WorkerHandle, ready: list[Any]) -> Any:
        """The worker's next reply, a WorkerDiedError if it is gone, or None if nothing yet."""
        if handle.conn in ready or handle.conn.poll():
            try:
                return pickle.loads(handle.conn.recv_bytes())
            except (EOFError, OSError):
                pass
        elif handle.process.sentinel not in ready:
            return None
        return WorkerDiedError(handle.rank, handle.exit_detail())

    # --------------------------------------------------------------- failures
    def _monitor_workers(self) -> None:
        sentinels = {h.process.sentinel: h for h in self.workers}
        ready = wait(list(sentinels))
        if self._shutting_down or not ready:
            return
        handle = sentinels[ready[0]]
        self._report_failure(WorkerDiedError(handle.rank, handle.exit_detail()))

    def shutdown(self) -> None:
        self._shutting_down = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            if self.is_failed:  # ranks may be stuck in a collective: no point waiting
                self._stop_grace[0] = 0.0
            finalizer()  # runs _stop_workers once
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(_TERMINATE_GRACE_S)


def _stop_workers(workers: list[_WorkerHandle], grace: list[float]) -> None:
    """Ask, then terminate, then kill; join every process (no zombie is left)."""
    for handle in workers:
        with contextlib.suppress(Exception):
            handle.conn.send_bytes(pickle.dumps(_SHUTDOWN))
    deadline = time.monotonic() + grace[0]
    for handle in workers:
        handle.join(max(deadline - time.monotonic(), 0))
    steps = (("terminate", process_start.request_stop, _TERMINATE_GRACE_S),
             ("kill", lambda process: process.kill(), None))
    for step, stop, grace in steps:
        alive = [h for h in workers if h.join(0) is None]
        if not alive:
            break
        logger.warning("%s worker rank(s) %s", step, [h.rank for h in alive])
        for handle in alive:
            stop(handle.process)
        for handle in alive:
            handle.join(grace)
    for handle in workers:
        with contextlib.suppress(Exception):
            handle.conn.close()


# ------------------------------------------------------------------ worker side
def worker_main(
    rank: int,
    worker_cls: str,
    worker_kwargs: dict[str, Any],
    conn: Connection,
    parent_pid: int,
) -> None:
    """A worker process: build the worker, then serve calls until told to stop."""
    from vllm.logger import set_process_label

    set_process_label(f"worker rank {rank} pid {os.getpid()}")
    process_start.ignore_group_signals()
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    wrapper = WorkerWrapper(rank)
    try:
        wrapper.init_worker(worker_cls, worker_kwargs)
    except BaseException as e:
        _send(conn, ("failed", RemoteFailure.capture(e)))
        return
    _send(conn, ("ready", os.getpid()))
    try:
        _serve(wrapper, rank, conn)
    finally:
        try:
            wrapper.shutdown()
        except Exception:
            logger.exception("rank %d: worker shutdown raised", rank)
        _leave_distributed()


def _serve(wrapper: WorkerWrapper, rank: int, conn: Connection) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine closed its end
        if message == _SHUTDOWN:
            return
        seq, call = message
        try:
            result = call.run(wrapper)
            reply = (seq, True, None if call.unique_reply_rank not in (None, rank) else result)
        except Exception as e:
            reply = (seq, False, RemoteFailure.capture(e))
        if not _send(conn, reply):
            return


def _send(conn: Connection, message: Any) -> bool:
    """Send `message`; a result that does not pickle is reported as the call's failure."""
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        seq = message[0] if isinstance(message, tuple) and len(message) == 3 else None
        data = pickle.dumps((seq, False, RemoteFailure(f"result does not pickle: {e!r}", "", None)))
    try:
        conn.send_bytes(data)
    except (BrokenPipeError, OSError):
        return False
    return True


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when the engine process is gone (we were re-parented)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _leave_distributed() -> None:
    import sys

    if "vllm.distributed.parallel_state" in sys.modules:
        from vllm.distributed.parallel_state import destroy_distributed_environment

        with contextlib.suppress(Exception):
            destroy_distributed_environment()
