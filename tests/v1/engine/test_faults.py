"""The engine core's one fault policy (faults.py) and the frontend <-> core protocol's
list of utility calls (protocol.py): plain values, no engine."""

from __future__ import annotations

import pytest

from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.faults import MAX_CONSECUTIVE_STEP_FAILURES, StepFailures, is_device_error
from vllm.v1.engine.protocol import UTILITY_METHODS, EngineCoreUtilities, utility_name
from vllm.v1.executor.worker_wrapper import WorkerDiedError, WorkerError


class AcceleratorError(RuntimeError):
    """Named as torch's (>= 2.8) CUDA / HIP fault: the type decides, not the message."""


def test_a_device_error_is_known_by_its_type_without_any_marker_in_the_message():
    assert is_device_error(AcceleratorError("an illegal memory access was encountered"))


def test_a_device_error_from_another_rank_is_known_by_the_type_name_in_its_reason():
    remote = WorkerError(1, "execute_model", "AcceleratorError: illegal address", "", None)
    assert is_device_error(remote)


def test_a_device_error_is_found_through_the_cause_chain():
    try:
        try:
            raise AcceleratorError("boom")
        except AcceleratorError as e:
            raise ValueError("while sampling") from e
    except ValueError as outer:
        assert is_device_error(outer)


def test_older_runtimes_are_known_by_the_runtime_message_on_a_runtime_error_only():
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    # A user's value that mentions CUDA is not a device fault.
    assert not is_device_error(ValueError("CUDA error in the prompt text"))
    assert not is_device_error(RuntimeError("injected step failure"))


def test_step_failures_fail_requests_until_the_limit_in_a_row():
    failures = StepFailures()
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        assert failures.failed(RuntimeError("one bad request")) is None
    failures.succeeded()  # a good step resets the count
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        assert failures.failed(RuntimeError("one bad request")) is None
    dead = failures.failed(RuntimeError("again"))
    assert dead is not None and f"{MAX_CONSECUTIVE_STEP_FAILURES} engine steps" in dead


def test_a_dead_worker_a_failed_executor_or_a_device_error_is_fatal_at_once():
    assert StepFailures().failed(WorkerDiedError(1, "killed by SIGKILL")) is not None
    assert StepFailures().failed(RuntimeError("x"), executor_failed=True) is not None
    assert "device error" in StepFailures().failed(AcceleratorError("x"))


def test_the_utility_list_is_the_protocol_and_the_engine_core_implements_it():
    assert {"sleep", "wake_up", "is_sleeping", "reload_weights",
                               "reset_prefix_cache", "get_stats", "kv_cache_memory",
                               "set_kv_cache_limit"} == UTILITY_METHODS
    for name in UTILITY_METHODS:
        assert callable(getattr(EngineCore, name)), name


def test_a_utility_call_names_a_protocol_method_only():
    assert utility_name(EngineCoreUtilities.sleep) == "sleep"
    for bad in ("sleep", EngineCore.sleep, EngineCore.add_request, print):
        with pytest.raises(ValueError, match="not an EngineCoreUtilities method"):
            utility_name(bad)
