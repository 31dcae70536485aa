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


def test_a_device_others_filled_refuses_before_it_is_touched(monkeypatch):
    # Issue #18 item 5: NVML says 0.4 GiB free and lists the other engine; the
    # worker says so in one line before creating a context (no CUDA traceback).
    from vllm.exceptions import DeviceBusyError

    engine = [DeviceProcess(pid=777, used_bytes=int(137.9 * (1 << 30)), name="vllm")]
    monkeypatch.setattr(current_platform, "free_bytes_before_init", lambda index=0: 400 << 20)
    monkeypatch.setattr(current_platform, "get_foreign_device_processes", lambda index=0: engine)
    touched = []
    monkeypatch.setattr(current_platform, "configure_threads", lambda: touched.append(1))
    worker = Worker(_config(gpu_memory_utilization=0.3).create_engine_config())
    with pytest.raises(DeviceBusyError) as info:
        worker.init_device()
    message = str(info.value)
    assert "\n" not in message and "only 0.4 GiB free" in message
    assert "pid 777 vllm (137.9 GiB)" in message and "--enable-elastic-kv-cache" in message
    assert worker.memory is None


def test_an_elastic_engine_shares_on_the_default_utilization(another_process, caplog):
    worker = Worker(_config(enable_elastic_kv_cache=True).create_engine_config())
    with caplog.at_level(logging.INFO, logger="vllm"):
        worker.init_device()
    assert any("pid 4242" in r.getMessage() and "elastic" in r.getMessage()
               for r in caplog.records)


def test_serve_prints_one_line_when_the_device_is_busy(monkeypatch, capsys):
    from vllm.entrypoints.cli.main import main
    from vllm.entrypoints.openai import api_server
    from vllm.exceptions import DeviceBusyError

    def busy(*args, **kwargs):
        raise DeviceBusyError("cannot start on cuda:0: only 0.4 GiB free, held by pid 777")

    monkeypatch.setattr(api_server, "run_server", busy)
    assert main(["serve", "--max-model-len", "128", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err == ("vllm serve: error: cannot start on cuda:0: only 0.4 GiB free, held by "
                   "pid 777\n")
