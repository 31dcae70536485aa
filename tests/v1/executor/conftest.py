"""Shared helpers for the executor tests: configs for the test workers, process checks."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psutil

from vllm.config import ParallelConfig


def make_config(world_size: int, backend: str, worker: str = "DistWorker", **extra):
    """What an executor reads of a VllmConfig: parallel_config (plus test knobs)."""
    parallel = ParallelConfig(
        tensor_parallel_size=world_size,
        distributed_executor_backend=backend,
        worker_cls=f"tests.v1.executor.workers.{worker}",
    )
    return SimpleNamespace(parallel_config=parallel, **extra)


def gone(pids, timeout: float = 10.0) -> bool:
    """True once none of `pids` exists any more (a zombie still counts as existing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False
