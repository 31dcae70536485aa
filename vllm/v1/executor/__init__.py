"""Executors: how the engine core drives one worker per rank (see abstract.py)."""

from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.worker_wrapper import WorkerDiedError, WorkerError

__all__ = ["Executor", "WorkerDiedError", "WorkerError"]
