"""The engine's Worker with a device that reports less free memory, and other test workers.

`VLLM_TEST_FREE_BYTES="A,B,..."` caps what rank r's `DeviceMemory.free_bytes()`
reports at the r-th value, so ranks of one engine see different free memory
(as GPUs do when another process holds memory on one of them). Everything else,
sizing and the agreement across ranks included, is the real worker.
"""

from __future__ import annotations

import os

import torch

from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import rpc


class LimitedMemoryWorker(Worker):
    @rpc
    def init_device(self) -> None:
        super().init_device()
        limits = os.environ.get("VLLM_TEST_FREE_BYTES")
        if not limits:
            return
        limit = int(limits.split(",")[self.rank])
        real = self.memory.free_bytes
        self.memory.free_bytes = lambda: min(real(), limit)


class ForeignMemoryWorker(Worker):
    """On CUDA: rank 1's GPU loses all but `VLLM_TEST_FOREIGN_LEAVE_GIB` (default 1.5)
    GiB of its free memory to an allocation the engine does not account for, made
    before it measures anything; as another process's memory would, it shrinks what
    that rank can give the KV cache."""

    @rpc
    def init_device(self) -> None:
        if self.rank == 1:
            torch.cuda.set_device(self.local_rank)
            leave = float(os.environ.get("VLLM_TEST_FOREIGN_LEAVE_GIB", "1.5"))
            free, _ = torch.cuda.mem_get_info()
            self.foreign = torch.cuda.caching_allocator_alloc(free - int(leave * (1 << 30)))
        super().init_device()


class NoVmmOnRank1Worker(LimitedMemoryWorker):
    """Rank 1's device "cannot" hold the extensible cache: its VMM probe reports a reason
    (the device boundary; as a GPU whose driver lacks cuMem* would)."""

    @rpc
    def probe_kv_cache_path(self) -> str | None:
        if self.rank == 1:
            return "VMM unsupported on this device (test)"
        return super().probe_kv_cache_path()


class DevicePerRankWorker(Worker):
    """Each rank on a device of its own in the elastic engines' registry ("host-rank<r>"),
    as tensor parallelism over GPUs is: the engine has an entry in each device's registry,
    in that rank's bytes (on the CPU both ranks share "host")."""

    @rpc
    def kv_cache_device(self) -> tuple[str, int]:
        _, block_bytes = super().kv_cache_device()
        return f"host-rank{self.rank}", block_bytes


def kv_cache_state(worker: Worker) -> tuple[int, int, list[str]]:
    """For `collective_rpc`: (KV base address, committed KV bytes, sleeping tags) of a rank."""
    base = next(iter(worker.kv_cache.views.values())).data_ptr()
    return base, worker.kv_cache.committed_bytes, worker.sleeping_tags()
