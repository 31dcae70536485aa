"""Offline `--scheduling-policy priority`: `LLM.generate(..., priority=[...])` and
`LLMEngine.add_request(..., priority=)` order admission (one seat: max_num_seqs=1)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.scripted_model import build_scripted_model
from vllm import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM

    engine = LLM(model=str(build_scripted_model(tmp_path_factory.mktemp("scripted"))),
                 max_model_len=256, max_num_seqs=1, max_num_batched_tokens=128,
                 kv_cache_memory_bytes=16 * 2**20, scheduling_policy="priority")
    yield engine
    engine.llm_engine.shutdown()


def _finish_order(llm, priorities: dict[str, int]) -> list[str]:
    engine = llm.llm_engine
    for request_id, priority in priorities.items():
        engine.add_request(request_id, "Hello", PARAMS, priority=priority)
    order: list[str] = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_engine_admits_lower_priority_first_ties_by_arrival(llm):
    assert _finish_order(llm, {"a": 2, "b": 0, "c": 2, "d": -1, "e": 0}) == [
        "d", "b", "e", "a", "c"]


def test_generate_takes_one_priority_per_prompt(llm):
    outputs = llm.generate(["Hello", "Paris"], PARAMS, use_tqdm=False, priority=[5, -5])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    assert [o.prompt for o in outputs] == ["Hello", "Paris"]  # input order, whatever ran first
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["Hello", "Paris"], PARAMS, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate("Hello", PARAMS, use_tqdm=False, priority=["high"])
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
