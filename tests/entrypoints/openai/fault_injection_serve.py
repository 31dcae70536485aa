"""A worker with a device-fault injector in front of the model runner (tests only).

Usage: vllm serve ... \
    --worker-cls tests.entrypoints.openai.fault_injection_serve.FaultInjectingWorker

Before every model step the worker checks the file named by
$VLLM_TEST_FAULT_FILE. If it exists, it is removed and the step raises
instead of running the model:
    "step"  RuntimeError: one failed step; the server must fail only that
            step's requests (HTTP 500) and keep serving.
    "cuda"  a CUDA-style device error; the engine must die, /health must say
            503 and the process must exit non-zero.
Before every wake_up (sleep mode) it reads the same file:
    "wake_map:N"  the VMM driver's map succeeds N times during this wake, then
            raises VmmError "out of memory" (N=0: no memory at all; N=1 after a
            level-2 sleep: the weights map, the KV cache does not).
The model runner and the VMM driver are the device boundary, so these are the
places a test may fake a fault; everything else (scheduler, engine core process, AsyncLLM,
server) is real. A worker class (not a patch of the server process) because
the worker runs in the engine core's process.
"""

from __future__ import annotations

import os

from vllm.device_allocator.vmm import VmmError
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import rpc


def _take_fault(prefix: str) -> str | None:
    """The fault file's text if it starts with `prefix` (the file is removed), else None."""
    fault_file = os.environ["VLLM_TEST_FAULT_FILE"]
    try:
        with open(fault_file) as f:
            kind = f.read().strip()
    except FileNotFoundError:
        return None
    if not kind.startswith(prefix):
        return None
    os.remove(fault_file)
    return kind


class FaultInjectingWorker(Worker):
    @rpc
    def wake_up(self, tags=None):
        kind = _take_fault("wake_map:")
        if kind is None:
            return super().wake_up(tags)
        driver = self.kv_cache.driver
        real_map, left = driver.map, [int(kind.split(":")[1])]

        def failing_map(va, size, handle):
            if left[0] == 0:
                raise VmmError(f"map(size={size}) failed: out of memory (injected)")
            left[0] -= 1
            return real_map(va, size, handle)

        driver.map = failing_map
        try:
            return super().wake_up(tags)
        finally:
            del driver.map  # the instance attribute goes; the class's method is back

    @rpc
    def execute_model(self, scheduler_output):
        kind = _take_fault("")
        if kind is None:
            return super().execute_model(scheduler_output)
        if kind == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        raise RuntimeError("injected step failure")
