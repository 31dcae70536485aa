"""The device the engine sizes against: the real one, or an emulated smaller one.

`benchmarks/benchmark_elastic.py --device-gib 58` emulates a 58 GiB device on an
80 GB H100: a ballast process holds the rest of the free memory, and the servers get
`VLLM_EMULATED_DEVICE_GIB=58`, so what is sized as a share of the device (the
elastic headroom's 2 %, `--gpu-memory-utilization`) is a share of 58 GiB.
"""

from __future__ import annotations

import pytest
import torch

from vllm import envs
from vllm.platforms import current_platform
from vllm.v1.worker.elastic_kv_cache import elastic_headroom_bytes
from vllm.v1.worker.memory import DeviceMemory, device_total

GiB = 1 << 30
H100 = 85_029_158_912  # torch.cuda.mem_get_info()[1] on an H100 80GB HBM3: 79.19 GiB


def test_the_elastic_headroom_of_an_emulated_device_is_two_percent_of_its_size(monkeypatch):
    """The headroom was 2 % of the card (1.58 GiB of the H100's 79.19 GiB) under
    --device-gib 58; it is 2 % of the 58 GiB the engines see: 1.16 GiB."""
    assert elastic_headroom_bytes(device_total(H100)) == 1_700_583_178  # int(0.02 x H100)
    monkeypatch.setenv("VLLM_EMULATED_DEVICE_GIB", "58")
    envs.reset()
    assert device_total(H100) == 58 * GiB
    assert elastic_headroom_bytes(device_total(H100)) == 1_245_540_515  # int(0.02 x 58 GiB)
    # A device no larger than asked is itself (the ballast then holds nothing).
    monkeypatch.setenv("VLLM_EMULATED_DEVICE_GIB", "100")
    envs.reset()
    assert device_total(H100) == H100


def test_the_host_is_emulated_the_same_way(monkeypatch):
    """On the CPU the worker's readings (`DeviceMemory.total`: what sizing and the elastic
    growth read) are the emulated host's too."""
    real = DeviceMemory(current_platform, torch.device("cpu")).total
    assert real == current_platform.mem_get_info()[1]
    monkeypatch.setenv("VLLM_EMULATED_DEVICE_GIB", "0.5")
    envs.reset()
    assert DeviceMemory(current_platform, torch.device("cpu")).total == GiB // 2 < real


@pytest.mark.parametrize("text", ["0", "-1", "abc", "inf"])
def test_an_emulated_size_that_is_not_a_positive_number_names_the_variable(monkeypatch, text):
    monkeypatch.setenv("VLLM_EMULATED_DEVICE_GIB", text)
    envs.reset()
    with pytest.raises(ValueError, match="VLLM_EMULATED_DEVICE_GIB"):
        device_total(H100)
