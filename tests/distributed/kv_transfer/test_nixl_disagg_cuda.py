"""1P1D over NIXL on one GPU (VRAM, UCX): two instances at an explicit share of the device.

Random weights of the SmolLM2 shape (`--load-format dummy`, seeded: every
process gets the same weights), so no model file has to reach the GPU machine.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from benchmarks.benchmark_disagg import PROXY, _serve
from benchmarks.common import model_dir_for
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.cuda
pytest.importorskip("nixl_cu13", reason="needs nixl-cu13")

PROMPTS = [f"Item {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (1 + i)
           for i in range(8)]


def _args(role: str | None) -> list[str]:
    args = ["--model", model_dir_for("smollm2"), "--load-format", "dummy",
            "--gpu-memory-utilization", "0.3", "--max-model-len", "1024",
            "--disable-log-stats", "--uvicorn-log-level", "warning"]
    if role:
        args += ["--kv-transfer-config",
                 json.dumps({"kv_connector": "NixlConnector", "kv_role": role})]
    return args


def _greedy(url: str) -> list[list[int]]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def test_1p1d_on_one_gpu_equals_one_instance():
    with RemoteServer(_args(None)) as single:
        reference = _greedy(single.url)
    with RemoteServer(_args("kv_producer")) as prefill, \
            RemoteServer(_args("kv_consumer")) as decode:
        with _serve(["--prefill", prefill.url, "--decode", decode.url], command=PROXY) as proxy:
            assert _greedy(proxy.url) == reference
        for server in (prefill, decode):
            log = server.startup_log
            # One physical allocation per registered segment (UCX cannot span several).
            allocations = re.search(r"defragmented for NixlConnector: \d+ physical "
                                    r"allocation\(s\) -> (\d+)", log)
            regions = re.search(r"registered (\d+) region\(s\)", log)
            assert allocations and regions, log[-3000:]
            assert int(allocations.group(1)) == int(regions.group(1))
            print(f"{allocations.group(0)}; {regions.group(0)}")


def test_transfer_flags_probed_and_allocations_still_work():
    from vllm.device_allocator.gpu_vmm import CudaVmmDriver

    driver = CudaVmmDriver(0)
    driver.enable_transfer_flags()
    assert driver.rdma_capable is not None
    assert driver.rdma_capable or driver.rdma_unsupported_reason
    size = driver.granularity
    va = driver.reserve(size)
    handle = driver.create(size)  # with the RDMA and POSIX-fd flags where supported
    driver.map(va, size, handle)
    driver.set_access(va, size)
    driver.unmap(va, size)
    driver.release(handle)
    driver.free_reservation(va, size)
    print(f"rdma_capable={driver.rdma_capable} reason={driver.rdma_unsupported_reason}")
