"""The engine's Worker with a device that reports less free memory (tests only).

`VLLM_TEST_FREE_BYTES="A,B,..."` caps what rank r's `DeviceMemory.free_bytes()`
reports at the r-th value, so ranks of one engine see different free memory
(as GPUs do when another process holds memory on one of them). Everything else,
sizing and the agreement across ranks included, is the real worker.
"""

from __future__ import annotations

import os

from vllm.v1.worker.gpu_worker import Worker


class LimitedMemoryWorker(Worker):
    def init_device(self) -> None:
        super().init_device()
        limits = os.environ.get("VLLM_TEST_FREE_BYTES")
        if not limits:
            return
        limit = int(limits.split(",")[self.rank])
        real = self.memory.free_bytes
        self.memory.free_bytes = lambda: min(real(), limit)
