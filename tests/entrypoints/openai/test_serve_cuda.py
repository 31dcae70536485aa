"""`vllm serve` on a GPU at default flags: only the engine core holds device memory.

The API server builds the config; torch's bf16 check used to create a CUDA
context there (0.5 GiB on the H200), and the engine core then refused to start
("another process holds memory on cuda:0 ... default 1.0"), the frontend being
that process. Random weights of a tiny model keep it self-contained.
"""

from __future__ import annotations

import os

import psutil
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.model_dirs import llama_config, make_model_dir

pytestmark = pytest.mark.cuda


def _device_pids() -> set[int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return pids
    finally:
        pynvml.nvmlShutdown()


def test_serve_at_default_flags_keeps_the_api_server_off_the_device(tmp_path):
    if os.getpid() in _device_pids():
        # Earlier CUDA tests left this pytest process on the device, and a server at
        # default flags rightly refuses to share it (seen on the H200 after
        # test_engine_cuda; a child pytest does not help: this process stays on it).
        pytest.skip("this pytest process holds device memory: run this file in a pytest of its own")
    model_dir = make_model_dir(tmp_path / "tiny", llama_config(), weights=True)
    with RemoteServer([str(model_dir), "--max-model-len", "512", "--max-num-seqs", "8"]) as server:
        children = {c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)}
        on_device = _device_pids()
        assert server.proc.pid not in on_device, "the API server holds device memory"
        assert children & on_device, "the engine core is not on the device"
        completion = server.get_client().completions.create(
            model=str(model_dir), prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert completion.choices[0].finish_reason == "length"
