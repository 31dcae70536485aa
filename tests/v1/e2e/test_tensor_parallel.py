"""The offline engine at tensor_parallel_size=2 on the bundled model (fp32, CPU, gloo):
greedy token ids equal one rank's, every rank uses the same block count, that
count is the minimum the ranks could hold when their free memory differs, and
sleep / wake happen on every rank at the same addresses."""

from __future__ import annotations

import pytest

from tests.conftest import TP_PROMPTS
from tests.v1.e2e.tp_workers import kv_cache_state
from vllm import LLM, SamplingParams
from vllm.entrypoints.cli import kv_top
from vllm.v1.worker.gpu_worker import Worker

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
    agreements = core.model_executor.collective_rpc(Worker.kv_cache_agreement)
    assert agreements[0] == agreements[1]  # every rank saw every rank's count
    proposals = agreements[0]
    memory = core.model_executor.collective_rpc(Worker.kv_cache_memory)
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


MiB = 1 << 20
# 8 distinct prompts of ~280 tokens: ~150 blocks in flight, above the floor (128).
BURST = [f"Write a short story number {i} about a lighthouse keeper and the sea." * 20
         for i in range(8)]


def test_mp_tp2_elastic_ranks_agree_at_start_after_growth_and_after_shrink(tp_reference,
                                                                          monkeypatch, tmp_path):
    # SmolLM2's 3 KV heads split 2 + 1, so rank 0's blocks are twice rank 1's: one
    # 2 MiB host granule per segment holds 128 of rank 0's blocks and 256 of rank
    # 1's. Each rank's own floor thus differs; the ranks must agree on one count
    # (the smallest) or the engine never starts ("the ranks ended with different
    # block counts: [128, 256]").
    # Each rank on a device of its own in the registry, as on two GPUs: `vllm kv-top`
    # shows the engine's limit as set and as /metrics reports it, not each rank's part.
    monkeypatch.setenv("VLLM_ELASTIC_KV_SHRINK_DELAY_S", "0")
    monkeypatch.setenv("VLLM_KV_REGISTRY_DIR", str(tmp_path))
    llm = LLM(**ENGINE, kv_cache_memory_bytes=256 * MiB, tensor_parallel_size=2,
              distributed_executor_backend="mp", enable_elastic_kv_cache=True,
              worker_cls="tests.v1.e2e.tp_workers.DevicePerRankWorker")
    try:
        core = llm.llm_engine.engine_core
        run = core.model_executor.collective_rpc
        policy = core.scheduler.elastic

        def committed() -> int:
            """The count every rank holds (asserting they hold the engine's)."""
            counts = [m.num_blocks for m in run(Worker.kv_cache_memory)]
            assert counts == [core.num_blocks] * 2, counts
            bounds = run(Worker.elastic_kv_cache_bounds)
            assert bounds[0] == bounds[1], bounds  # floor, limit, max_limit, chunk
            return counts[0]

        floor = policy.floor
        assert committed() == floor == 128  # rank 0's, the smaller
        assert greedy_ids(llm) == reference_ids(tp_reference)

        policy.shrink_delay_s = 1e9  # hold the growth until the burst is done
        llm.generate(BURST, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        assert policy.num_grows >= 1
        assert committed() > floor

        policy.shrink_delay_s = 0.0
        for _ in range(20):
            llm.llm_engine.engine_core.adjust_kv_cache()
            if core.num_blocks == floor:
                break
        assert policy.num_shrinks >= 1
        assert committed() == floor

        # Bytes summed over the ranks, the unit /metrics reports: a block is 16 KiB in
        # each of 30 segments on rank 0 and 8 KiB on rank 1, 720 KiB in all; 135 MiB
        # (and anything short of the next block) is 192 blocks on both ranks.
        block_bytes = (16 + 8) * 1024 * 30
        assert llm.llm_engine.set_kv_cache_limit(192 * block_bytes + block_bytes - 1) == 192
        assert [b.limit for b in run(Worker.elastic_kv_cache_bounds)] == [192, 192]
        assert core.kv_cache_memory().limit_bytes == 192 * block_bytes == 135 * MiB
        (engine,) = kv_top.engines(kv_top.snapshot(str(tmp_path)))
        assert engine["devices"] == ["host-rank0", "host-rank1"]
        assert (engine["limit"], engine["committed"]) == (135 * MiB, floor * block_bytes)
        assert "135.00 MiB" in kv_top.render(kv_top.snapshot(str(tmp_path))).splitlines()[1]
        limit = llm.llm_engine.set_kv_cache_limit(None)
        assert [b.limit for b in run(Worker.elastic_kv_cache_bounds)] == [limit, limit]
        assert committed() == floor
        assert greedy_ids(llm) == reference_ids(tp_reference)
    finally:
        llm.llm_engine.shutdown()
