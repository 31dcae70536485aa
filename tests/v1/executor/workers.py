"""Test workers for the executors: real torch.distributed (gloo) groups in real processes.

An executor builds `worker_cls(vllm_config=..., local_rank=..., rank=...,
distributed_init_method=..., is_driver_worker=...)` in every rank's process;
these classes take the same arguments as the engine's Worker, and mark what the
tests call with `@rpc`, as the engine's Worker does.
"""

from __future__ import annotations

import os
import time

import torch

from vllm.distributed import (
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.v1.worker.worker_base import rpc


class DistWorker:
    """Joins the ranks' gloo group at `init_device`; small methods the tests call."""

    def __init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker):
        self.config = vllm_config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = vllm_config.parallel_config.world_size
        self.init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        if rank in getattr(vllm_config, "fail_ranks", ()):
            raise ValueError(f"rank {rank} refuses to start (test)")

    @rpc
    def init_device(self) -> int:
        torch.set_num_threads(1)
        init_distributed_environment(self.world_size, self.rank, self.init_method, backend="gloo")
        initialize_model_parallel(self.world_size)
        return get_tp_group().rank_in_group

    @rpc
    def all_reduce(self, value: float) -> float:
        """Sum of `value + rank` over the ranks (a real gloo all-reduce)."""
        x = torch.tensor([value + self.rank], dtype=torch.float64)
        return float(get_tp_group().all_reduce(x).item())

    @rpc
    def whoami(self) -> tuple[int, int, bool]:
        return self.rank, os.getpid(), self.is_driver_worker

    @rpc
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad value on rank {rank}")
        return self.rank

    @rpc
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @rpc
    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    @rpc
    def fail_before_collective(self, rank: int) -> float:
        """`rank` raises; the others wait in an all-reduce it never joins."""
        if self.rank == rank:
            raise RuntimeError(f"rank {rank} gave up before the all-reduce")
        return self.all_reduce(0.0)

    @rpc
    def unpicklable(self):
        return lambda: None  # lambdas do not pickle: the call must fail, not hang

    def not_offered(self) -> None:
        """Not marked @rpc: the engine may not call it."""

    @rpc
    def die(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(3)
        return self.rank


class ModelWorker(DistWorker):
    """Loads a model sharded over the ranks and runs the shared test schedule through it."""

    @rpc
    def forward_logits(self, path: str, config_path: str | None = None) -> dict[str, torch.Tensor]:
        """Per request of the schedule, its logits; `config_path` holds the HF config
        when `path` is a GGUF file written without one."""
        from tests.model_executor.generation import run_schedule, schedule_sequences
        from vllm.model_executor.model_loader import get_model
        from vllm.transformers_utils.config import get_hf_config

        config = get_hf_config(config_path or path)
        model = get_model(
            path, config, torch.float32, "cpu", tp_rank=self.rank, tp_size=self.world_size
        )
        return run_schedule(model, schedule_sequences(config.vocab_size, seed=11), block_size=4)


def pid_of(worker: DistWorker) -> int:
    """A module-level function: collective_rpc also takes one (called with the worker)."""
    return os.getpid()


class NcclGraphWorker(DistWorker):
    """On CUDA: an NCCL all-reduce captured in a CUDA graph, then replayed."""

    @rpc
    def init_device(self) -> int:
        torch.cuda.set_device(self.local_rank)
        init_distributed_environment(
            self.world_size, self.rank, self.init_method, self.local_rank, backend="nccl"
        )
        initialize_model_parallel(self.world_size)
        return get_tp_group().rank_in_group

    @rpc
    def all_reduce_in_graph(self) -> list[float]:
        group = get_tp_group()
        x = torch.zeros(3, device="cuda")
        group.all_reduce(x)  # warm the communicator up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            group.all_reduce(x)
        x.fill_(self.rank + 1.0)  # 1 + 2 summed over the two ranks
        graph.replay()
        torch.cuda.synchronize()
        return x.tolist()
