"""Sharing a device: refuse on the default utilization, warn when it was set (DESIGN.md 5).

The platform's process query (NVML / amdsmi) is replaced at that boundary.
"""

from __future__ import annotations

import logging

import pytest

from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceProcess
from vllm.v1.worker.gpu_worker import Worker

OTHER = [DeviceProcess(pid=4242, used_bytes=3 << 30, name="trainer")]


def _config(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128, **kwargs)


@pytest.fixture
def another_process(monkeypatch):
    monkeypatch.setattr(current_platform, "get_foreign_device_processes", lambda index=0: OTHER)


def test_default_utilization_refuses_to_share(another_process):
    worker = Worker(_config().create_engine_config())
    with pytest.raises(RuntimeError, match="--gpu-memory-utilization") as info:
        worker.init_device()
    assert "pid 4242" in str(info.value) and "3.0 GiB" in str(info.value)


def test_explicit_utilization_warns_and_starts(another_process, caplog):
    worker = Worker(_config(gpu_memory_utilization=0.5).create_engine_config())
    with caplog.at_level(logging.WARNING, logger="vllm"):
        worker.init_device()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pid 4242" in warnings[0].getMessage()
    assert "0.5" in warnings[0].getMessage()


@pytest.mark.parametrize("others", [None, []])
def test_unknown_or_no_other_process_never_refuses(monkeypatch, caplog, others):
    """The query runs, finds nothing (or cannot tell), and the worker starts without a word."""
    queried = []

    def query(index=0):
        queried.append(index)
        return others

    monkeypatch.setattr(current_platform, "get_foreign_device_processes", query)
    worker = Worker(_config().create_engine_config())
    with caplog.at_level(logging.WARNING, logger="vllm"):
        worker.init_device()
    assert queried == [0]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert worker.memory is not None  # init_device ran to its end
