"""The `mp` executor: real worker processes, a real gloo group, failures named by rank."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import psutil
import pytest

from tests.v1.executor.conftest import gone, make_config
from tests.v1.executor.workers import DistWorker, NcclGraphWorker, pid_of
from vllm.v1.executor import Executor, WorkerDiedError, WorkerError
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture(scope="module")
def executor():
    executor = MultiprocExecutor(make_config(2, "mp"))
    assert executor.collective_rpc(DistWorker.init_device) == [0, 1]
    yield executor
    executor.shutdown()


def test_get_class():
    assert Executor.get_class(make_config(2, "mp")) is MultiprocExecutor


def test_ranks_are_processes_in_one_group(executor):
    ranks = executor.collective_rpc(DistWorker.whoami)
    assert [(rank, driver) for rank, _, driver in ranks] == [(0, True), (1, False)]
    pids = [pid for _, pid, _ in ranks]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(psutil.Process(pid).ppid() == os.getpid() for pid in pids)
    # (1.5 + 0) + (1.5 + 1) summed by gloo across the two processes, on both.
    assert executor.collective_rpc(DistWorker.all_reduce, args=(1.5,)) == [4.0, 4.0]
    assert executor.collective_rpc(pid_of) == pids
    assert executor.collective_rpc(DistWorker.whoami, unique_reply_rank=1) == [ranks[1]]


def test_worker_error_names_rank_and_keeps_running(executor):
    with pytest.raises(WorkerError, match=r"rank 1 failed in fail_on: ValueError: bad value") as e:
        executor.collective_rpc(DistWorker.fail_on, kwargs={"rank": 1})
    assert e.value.rank == 1 and isinstance(e.value.original, ValueError)
    assert "Traceback" in e.value.remote_traceback
    with pytest.raises(WorkerError, match="rank 0 failed in unpicklable: result does not pickle"):
        executor.collective_rpc(DistWorker.unpicklable)
    # What a worker offers is its @rpc methods, named by the method itself.
    with pytest.raises(TypeError, match="takes the worker method itself"):
        executor.collective_rpc("whoami")
    with pytest.raises(TypeError, match="DistWorker.not_offered is not marked @rpc"):
        executor.collective_rpc(DistWorker.not_offered)
    with pytest.raises(WorkerError, match="has no @rpc method 'all_reduce_in_graph'"):
        executor.collective_rpc(NcclGraphWorker.all_reduce_in_graph)
    assert executor.collective_rpc(DistWorker.all_reduce, args=(0.0,)) == [1.0, 1.0]


def test_timeout_then_late_replies_are_skipped(executor):
    with pytest.raises(TimeoutError, match=r"nap did not finish within 0.2 s on rank\(s\) \[0, "):
        executor.collective_rpc(DistWorker.nap, args=(1.0,), timeout=0.2)
    # The late replies of the timed-out call arrive first and are dropped.
    assert executor.collective_rpc(DistWorker.nap, args=(0.0,)) == [0, 1]


def test_a_rank_failing_out_of_a_collective_fails_the_executor(executor):
    """Rank 0 waits in an all-reduce rank 1 never joins: not a hang, a failed executor."""
    pids = [pid for _, pid, _ in executor.collective_rpc(DistWorker.whoami)]
    with pytest.raises(WorkerError, match="rank 1 failed in fail_before_collective"):
        executor.collective_rpc(DistWorker.fail_before_collective, args=(1,))
    assert executor.is_failed
    with pytest.raises(WorkerError):
        executor.check_health()
    executor.shutdown()  # rank 0 is stuck in gloo: terminated, then reaped
    assert gone(pids)


def test_start_up_failure_names_the_rank_and_leaves_no_process():
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(WorkerError, match=r"rank 1 failed in start-up: ValueError: rank 1 refuses"):
        MultiprocExecutor(make_config(2, "mp", fail_ranks=(1,)))
    new = {p.pid for p in psutil.Process().children()} - before
    assert gone(new, timeout=10)


def test_worker_death_in_a_call():
    """The sentinel ends the wait at once; the monitor reports it to the callbacks too.

    (A death between calls, found by the monitor alone, is tested through the
    server: tests/entrypoints/openai/test_processes.py.)
    """
    executor = MultiprocExecutor(make_config(2, "mp"))
    failures = []
    fired = threading.Event()
    executor.register_failure_callback(lambda e: (failures.append(e), fired.set()))
    pids = [pid for _, pid, _ in executor.collective_rpc(DistWorker.whoami)]
    try:
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 died \(exit code 3\)"):
            executor.collective_rpc(DistWorker.die, args=(1,))
        assert fired.wait(5) and failures[0].rank == 1
        with pytest.raises(WorkerDiedError, match="worker rank 1 died"):
            executor.collective_rpc(DistWorker.whoami)  # the executor stays failed
    finally:
        executor.shutdown()
    assert gone(pids)


ORPHAN_SCRIPT = """
import sys, time
from tests.v1.executor.conftest import make_config
from tests.v1.executor.workers import DistWorker
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
executor = MultiprocExecutor(make_config(2, "mp"))
print("PIDS", *[pid for _, pid, _ in executor.collective_rpc(DistWorker.whoami)], flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed():
    """SIGKILL leaves no chance to clean up: the workers notice their parent is gone."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = proc.stdout.readline()
            assert line, "the script ended before printing its workers' pids"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait()
    assert gone(pids, timeout=10), "worker processes outlived the engine process"


def test_two_threads_reaping_a_killed_process_both_read_its_signal():
    """The monitor thread and a call's thread both wake on a dead worker's sentinel and
    both name its exit: unlocked, the slower `waitpid` got ECHILD and read None
    ("died (still running)"), which failed a CI run."""
    import multiprocessing
    import signal
    import time

    from vllm.v1.executor.multiproc_executor import describe_exit, reap

    context = multiprocessing.get_context("fork")  # a bare child: no model, no imports
    for _ in range(20):
        process = context.Process(target=time.sleep, args=(60,), daemon=True)
        process.start()
        lock = threading.Lock()
        barrier = threading.Barrier(2)
        seen: list[str] = []

        def reaper(process=process, lock=lock, barrier=barrier, seen=seen) -> None:
            barrier.wait()
            seen.append(describe_exit(reap(process, lock, 5)))

        threads = [threading.Thread(target=reaper) for _ in range(2)]
        for thread in threads:
            thread.start()
        os.kill(process.pid, signal.SIGKILL)
        for thread in threads:
            thread.join(10)
        assert seen == ["killed by SIGKILL"] * 2
