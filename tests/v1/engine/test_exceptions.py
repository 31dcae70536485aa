"""`startup_errors`: what a rank in another process refused is reported as if the engine's
own process had raised it (the offline engine and `vllm bench` get a `WorkerError`)."""

from __future__ import annotations

import pytest

from vllm.exceptions import DeviceBusyError, EngineStartupError
from vllm.v1.engine.exceptions import startup_errors
from vllm.v1.executor.worker_wrapper import RemoteFailure, WorkerError
from vllm.v1.worker.kv_cache_sizing import KVCacheSizingError


def _from_rank(error: BaseException) -> WorkerError:
    try:
        raise error
    except BaseException as e:  # as the mp executor builds it from the rank's reply
        return RemoteFailure.capture(e).to_error(1, "initialize_kv_cache")


@pytest.mark.parametrize("error, code", [(ValueError("flag too small"), 2),
                                         (FileNotFoundError("no such file"), 2),
                                         (KVCacheSizingError("device too small"), 1)])
def test_a_known_refusal_from_another_rank_is_one_line_with_its_exit_code(error, code):
    with pytest.raises(EngineStartupError) as info, startup_errors():
        raise _from_rank(error)
    assert (str(info.value), info.value.exit_code) == (str(error), code)


def test_a_busy_device_from_another_rank_passes_as_itself_and_anything_else_as_sent():
    with pytest.raises(DeviceBusyError, match="pid 4242"), startup_errors():
        raise _from_rank(DeviceBusyError("pid 4242 holds cuda:1"))
    unknown = "rank 1 failed in initialize_kv_cache: RuntimeError: a bug"
    with pytest.raises(WorkerError, match=unknown), startup_errors():
        raise _from_rank(RuntimeError("a bug"))
