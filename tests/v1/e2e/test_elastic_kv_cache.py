"""The elastic KV cache on real host pages: it follows the load up and back down (issue #18).

The bundled model (SmolLM2-135M, fp32): 30 layers of 24 KiB blocks; a 2 MiB
host granule per layer holds 85 blocks. The engine starts with the floor (one
max_model_len request: 17 blocks, filling one granule per layer = 85 blocks,
60 MiB), grows under a burst of 16 requests and returns to the floor when idle
(`VLLM_ELASTIC_KV_SHRINK_DELAY_S=0`).
"""

from __future__ import annotations

import gc

import pytest

from vllm import LLM, SamplingParams

MiB = 1 << 20
PROMPTS = [f"Write a short story number {i} about a lighthouse keeper and the sea." * 8
           for i in range(16)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def elastic_llm():
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ELASTIC_KV_SHRINK_DELAY_S", "0")
    engine = LLM(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512,
                 kv_cache_memory_bytes=256 * MiB, enable_elastic_kv_cache=True)
    yield engine
    engine.llm_engine.shutdown()
    mp.undo()
    gc.collect()


def _texts(llm: LLM) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _idle_until_floor(llm: LLM, core) -> None:
    for _ in range(20):
        llm.llm_engine.adjust_kv_cache()
        if core.num_blocks == core.elastic.policy.floor:
            return


def test_committed_bytes_and_rss_follow_the_load_up_and_down(elastic_llm, offline_llm):
    core = elastic_llm.llm_engine.engine_core
    kv_cache = core.worker.kv_cache
    floor = core.elastic.policy.floor
    assert floor == kv_cache.committed_blocks == core.num_blocks == 85
    assert kv_cache.committed_bytes == 60 * MiB
    # Record every resize on the worker: (blocks, bytes, RSS) before and after.
    worker, trace = core.worker, []

    def traced(fn):
        def call(num_blocks):
            before = (kv_cache.committed_blocks, kv_cache.committed_bytes, _rss())
            out = fn(num_blocks)
            trace.append((before, (kv_cache.committed_blocks, kv_cache.committed_bytes, _rss())))
            return out
        return call

    worker.grow_kv_cache = traced(worker.grow_kv_cache)
    worker.shrink_kv_cache = traced(worker.shrink_kv_cache)
    texts = _texts(elastic_llm)  # 16 prompts of ~120 tokens: ~150 blocks in flight, 84 committed
    grows = [(a, b) for a, b in trace if b[0] > a[0]]
    assert grows and core.elastic.policy.num_grows == len(grows)
    assert max(b[0] for _, b in grows) > floor
    for a, b in grows:  # host commits are resident at once
        assert b[2] - a[2] >= 0.8 * (b[1] - a[1])
    assert texts == _texts(offline_llm)  # identical to the non-elastic engine (greedy, fp32)

    cached_before = len(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    _idle_until_floor(elastic_llm, core)
    assert core.num_blocks == kv_cache.committed_blocks == floor
    assert kv_cache.committed_bytes == 60 * MiB
    assert core.elastic.policy.num_shrinks >= 1
    shrinks = [(a, b) for a, b in trace if b[0] < a[0]]
    assert sum(a[1] - b[1] for a, b in shrinks) > 0
    for a, b in shrinks:  # the pages really left
        assert a[2] - b[2] >= 0.8 * (a[1] - b[1])
    memory = core.kv_cache_memory()
    assert memory.committed_bytes == 60 * MiB and memory.num_shrinks >= 1

    # The shrink evicted cached prefix blocks above the floor; the same prompts
    # again hit only what survived and still give the same text.
    cached_after = len(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert cached_after < cached_before
    hits_before = core.get_stats().prefix_cache_hits
    assert _texts(elastic_llm) == texts
    assert core.get_stats().prefix_cache_hits > hits_before  # survivors were reused
