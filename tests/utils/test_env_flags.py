"""`env_flag`: the on/off switches of the kernels (VLLM_FRESH_PREFILL_ATTENTION, VLLM_GEMV_PDL)."""

from __future__ import annotations

import pytest
import torch

from vllm.utils.env_flags import env_flag


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("true", True), (" ON ", True), ("0", False), ("False", False), ("off", False),
])
def test_on_and_off_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("VLLM_TEST_SWITCH", value)
    assert env_flag("VLLM_TEST_SWITCH", not expected) is expected


def test_unset_is_the_default(monkeypatch):
    monkeypatch.delenv("VLLM_TEST_SWITCH", raising=False)
    assert env_flag("VLLM_TEST_SWITCH", True) is True
    assert env_flag("VLLM_TEST_SWITCH", False) is False


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_anything_else_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_TEST_SWITCH", value)
    with pytest.raises(ValueError, match="VLLM_TEST_SWITCH must be 1/true/on or 0/false/off"):
        env_flag("VLLM_TEST_SWITCH", True)


def test_gemv_dependent_launch_switch(monkeypatch):
    from vllm.model_executor.layers.ops.gemv import dependent_launch

    assert not dependent_launch(torch.device("cpu"))  # a CUDA launch option only
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as NVIDIA builds say (CI's is CPU)
    monkeypatch.setenv("VLLM_GEMV_PDL", "0")
    assert not dependent_launch(torch.device("cuda"))  # off: the device is not even asked
    monkeypatch.setenv("VLLM_GEMV_PDL", "1")
    assert not dependent_launch(torch.device("cuda"), (8 << 20) + 1)  # a large weight
    monkeypatch.setenv("VLLM_GEMV_PDL", "maybe")
    with pytest.raises(ValueError, match="VLLM_GEMV_PDL must be"):
        dependent_launch(torch.device("cuda"), 1 << 20)
    monkeypatch.setattr(torch.version, "cuda", None)  # ROCm's torch: no griddepcontrol
    assert not dependent_launch(torch.device("cuda"), 1 << 20)
