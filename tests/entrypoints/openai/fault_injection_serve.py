"""`vllm serve` with a device-fault injector in front of the model runner (tests only).

Usage: python fault_injection_serve.py serve [flags]   (same flags as `vllm serve`)

Before every model step the worker checks the file named by
$VLLM_TEST_FAULT_FILE. If it exists, it is removed and the step raises
instead of running the model:
    "step"  RuntimeError: one failed step; the server must fail only that
            step's requests (HTTP 500) and keep serving.
    "cuda"  a CUDA-style device error; the engine must die, /health must say
            503 and the process must exit non-zero.
The model runner is the device boundary, so this is the one place a test may
fake a fault; everything else (scheduler, AsyncLLM, server) is real.
"""

from __future__ import annotations

import os
import sys

from vllm.entrypoints.cli.main import main
from vllm.v1.worker.gpu_worker import Worker

_FAULT_FILE = os.environ["VLLM_TEST_FAULT_FILE"]
_real_execute_model = Worker.execute_model


def _execute_model_with_faults(self, scheduler_output):
    try:
        with open(_FAULT_FILE) as f:
            kind = f.read().strip()
        os.remove(_FAULT_FILE)
    except FileNotFoundError:
        return _real_execute_model(self, scheduler_output)
    if kind == "cuda":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    raise RuntimeError("injected step failure")


Worker.execute_model = _execute_model_with_faults

if __name__ == "__main__":
    sys.exit(main())
