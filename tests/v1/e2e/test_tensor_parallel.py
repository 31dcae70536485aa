"""The offline engine at tensor_parallel_size=2 on the bundled model (fp32, CPU, gloo):
greedy token ids equal one rank's, every rank uses the same block count, that
count is the minimum the ranks could hold when their free memory differs, and
sleep / wake happen on every rank at the same addresses."""

from __future__ import annotations

import pytest

from tests.conftest import TP_PROMPTS
from tests.v1.e2e.tp_workers import kv_cache_state
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy_ids(llm: LLM) -> dict[str, list[int]]:
    outputs = llm.generate(TP_PROMPTS, GREEDY, use_tqdm=False)
    return {o.prompt: list(o.outputs[0].token_ids) for o in outputs}


def reference_ids(tp_reference) -> dict[str, list[int]]:
    return {prompt: ids for prompt, (ids, _) in tp_reference.items()}


def check_agreement(llm: LLM) -> list[int]:
    """Both ranks hold the engine's block count, the minimum of what each could hold."""
    core = llm.llm_engine.engine_core
    agreements = core.model_executor.collective_rpc("kv_cache_agreement")
    assert agreements[0] == agreements[1]  # every rank saw every rank's count
    proposals = agreements[0]
    memory = core.model_executor.collective_rpc("kv_cache_memory")
    assert [m.num_blocks for m in memory] == [core.num_blocks] * 2
    assert core.num_blocks == min(proposals)
    return proposals


LIMITED_MEMORY_WORKER = "tests.v1.e2e.tp_workers.LimitedMemoryWorker"


def test_mp_tp2_matches_tp1_ranks_take_the_minimum_and_sleep_together(tp_reference,
                                                                      limited_memory):
    # 64 sequences: the cap of what max_num_seqs x max_model_len can use (2049
    # blocks) is above what rank 1's 200 MiB holds, so its memory bounds the count.
    llm = LLM(**{**ENGINE, "max_num_seqs": 64}, tensor_parallel_size=2,
              distributed_executor_backend="mp", enable_extensible_kv_cache=True,
              worker_cls=LIMITED_MEMORY_WORKER, enable_sleep_mode=True)
    try:
        assert greedy_ids(llm) == reference_ids(tp_reference)
        proposals = check_agreement(llm)
        assert proposals[1] < proposals[0], proposals  # rank 1's free memory bounds it
        # Sleep and wake are collective: every rank releases its pages and maps them
        # again at the same addresses, and the ranks still compute together.
        run = llm.llm_engine.engine_core.model_executor.collective_rpc
        awake = run(kv_cache_state)
        assert all(committed > 0 and tags == [] for _, committed, tags in awake)
        llm.sleep(level=1)
        assert [(base, 0, ["weights", "kv_cache"]) for base, _, _ in awake] == run(kv_cache_state)
        llm.wake_up()
        assert run(kv_cache_state) == awake
        assert greedy_ids(llm) == reference_ids(tp_reference)
    finally:
        llm.llm_engine.shutdown()
