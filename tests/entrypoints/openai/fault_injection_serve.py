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
The model runner is the device boundary, so this is the one place a test may
fake a fault; everything else (scheduler, engine core process, AsyncLLM,
server) is real. A worker class (not a patch of the server process) because
the worker runs in the engine core's process.
"""

from __future__ import annotations

import os

from vllm.v1.worker.gpu_worker import Worker


class FaultInjectingWorker(Worker):
    def execute_model(self, scheduler_output):
        fault_file = os.environ["VLLM_TEST_FAULT_FILE"]
        try:
            with open(fault_file) as f:
                kind = f.read().strip()
            os.remove(fault_file)
        except FileNotFoundError:
            return super().execute_model(scheduler_output)
        if kind == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        raise RuntimeError("injected step failure")
