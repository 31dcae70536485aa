"""Requests whose structured-output grammar compiles in the background (WAITING_FOR_FSM).

The real scheduler and the fake runner, with a grammar source whose compiles
finish when the test says: a compile in flight never holds other requests
back, a finished one lets its request in with its grammar (sent to the runner
in NewRequestData), a failed one fails that request alone with an error, an
abort while compiling forgets it, and a cached grammar never waits.
"""

from __future__ import annotations

from concurrent.futures import Future

from tests.v1.core.fake_runner import FakeRunner, check_invariants, make_request, make_scheduler
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.outputs import FinishReason
from vllm.v1.request import RequestStatus

BS = 4


class HeldCompiles:
    """A grammar source whose futures the test resolves (key -> the one future)."""

    def __init__(self) -> None:
        self.futures: dict[tuple, Future] = {}
        self.submitted: list[tuple] = []

    def submit(self, params):
        key = params.key()
        self.submitted.append(key)
        return self.futures.setdefault(key, Future())


def _step(sched, runner):
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute_model(so))
    check_invariants(sched)
    return so, {o.request_id: o for o in outs}


def _constrained(req_id: str, regex: str = "[a-z]+", **kwargs):
    return make_request(req_id, 6, max_tokens=4, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(regex=regex), **kwargs)


def test_a_compile_in_flight_holds_nobody_back_and_its_request_runs_with_its_grammar():
    compiles = HeldCompiles()
    sched, runner = make_scheduler(block_size=BS, grammar_compiler=compiles), FakeRunner(BS)
    sched.add_request(make_request("plain", 6, max_tokens=12, ignore_eos=True))
    sched.add_request(_constrained("json"))
    # Queued behind "json": admitted while "json" waits at the head of the queue.
    sched.add_request(make_request("late", 5, max_tokens=2, ignore_eos=True))
    assert sched.requests["json"].status == RequestStatus.WAITING_FOR_FSM
    tokens = {"plain": 0, "late": 0}
    for _ in range(4):  # the compile runs: the others step on, "json" is never scheduled
        so, outs = _step(sched, runner)
        assert "json" not in so.num_scheduled_tokens
        for req_id, out in outs.items():
            tokens[req_id] += len(out.new_token_ids)
    assert tokens == {"plain": 4, "late": 2}
    assert sched.requests["json"].status == RequestStatus.WAITING_FOR_FSM
    assert sched.kv_cache_manager.get_block_ids("json") == []  # waits without blocks

    compiled = object()
    compiles.futures[("regex", "[a-z]+", False, False)].set_result(compiled)
    so, _ = _step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "json" and new.grammar is compiled
    assert sched.requests["json"].status == RequestStatus.RUNNING


def test_a_failed_compile_fails_its_request_alone():
    compiles = HeldCompiles()
    sched, runner = make_scheduler(block_size=BS, grammar_compiler=compiles), FakeRunner(BS)
    sched.add_request(make_request("plain", 6, max_tokens=3, ignore_eos=True))
    sched.add_request(_constrained("bad"))
    _step(sched, runner)
    compiles.futures[("regex", "[a-z]+", False, False)].set_exception(ValueError("boom"))
    so, outs = _step(sched, runner)
    assert outs["bad"].finish_reason == FinishReason.ABORT
    assert "did not compile: boom" in outs["bad"].error
    assert "bad" not in sched.requests and "bad" not in so.num_scheduled_tokens
    assert outs["plain"].new_token_ids


def test_abort_while_compiling_forgets_the_request():
    compiles = HeldCompiles()
    sched, runner = make_scheduler(block_size=BS, grammar_compiler=compiles), FakeRunner(BS)
    sched.add_request(_constrained("gone"))
    sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    compiles.futures[("regex", "[a-z]+", False, False)].set_result(object())
    so, outs = _step(sched, runner)
    assert not sched.requests and not sched.structured_outputs.compiling and not outs
    assert so.finished_req_ids == {"gone"}


def test_a_compiled_grammar_is_reused_without_waiting():
    compiles = HeldCompiles()
    sched, runner = make_scheduler(block_size=BS, grammar_compiler=compiles), FakeRunner(BS)
    done: Future = Future()
    done.set_result("grammar")
    compiles.futures[("regex", "[0-9]", False, False)] = done
    sched.add_request(_constrained("cached", regex="[0-9]"))
    assert sched.requests["cached"].status == RequestStatus.WAITING
    so, _ = _step(sched, runner)
    assert so.scheduled_new_reqs[0].grammar == "grammar"


def test_a_constrained_request_without_a_compiler_is_refused():
    sched = make_scheduler(block_size=BS)
    try:
        sched.add_request(_constrained("x"))
    except ValueError as e:
        assert "no grammar compiler" in str(e)
    else:
        raise AssertionError("accepted a constraint nobody can compile")
    assert not sched.requests
