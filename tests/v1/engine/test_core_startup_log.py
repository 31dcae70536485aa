"""The engine's start-up line (vLLM's "Initializing a V1 LLM engine (vX) with config: ..."):
one INFO line with `VllmConfig.summary()`, async scheduling included, logged by the engine
core, so once per engine (the server's line is checked in test_cli, on its shared server)."""

from __future__ import annotations

import logging

import pytest

from vllm.v1.executor import Executor
from vllm.version import __version__


class _Stop(Exception):
    pass


def test_the_offline_engine_logs_its_config_once_before_the_workers_start(monkeypatch, caplog):
    from vllm import LLM

    configs = []

    def stop(vllm_config):  # the executor is built right after the line: stop there
        configs.append(vllm_config)
        raise _Stop

    monkeypatch.setattr(Executor, "get_class", stop)
    with caplog.at_level(logging.INFO, logger="vllm"), pytest.raises(_Stop):
        LLM(max_model_len=128, async_scheduling=False)
    (config,) = configs
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("Initializing a V1 LLM engine")]
    assert lines == [f"Initializing a V1 LLM engine (v{__version__}) with config: "
                     f"{config.summary()}"]
    assert "async_scheduling=False" in lines[0] and "max_model_len=128" in lines[0]
