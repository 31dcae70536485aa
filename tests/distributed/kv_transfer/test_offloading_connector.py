"""OffloadingConnector, bundled model: a prefix evicted from the KV cache comes back from host."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from vllm import LLM, SamplingParams

# One block of the bundled model: 16 tokens x 30 layers x (K, V) x 3 KV heads x 64 x fp32.
BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4
# 5 blocks (4 usable, 64 tokens): one ~50-token request fits, two do not, so the second
# evicts the first.
SMALL_CACHE = dict(ENGINE_KWARGS, max_num_seqs=2, kv_cache_memory_bytes=5 * BLOCK_BYTES,
                   max_model_len=64)
LONG_A = ("Here is a long story about a lighthouse keeper who lived alone on a rocky island "
          "far from the coast, counting ships and writing letters that he never sent to anyone. "
          "One morning he found a bottle on the shore. Inside the bottle was")
LONG_B = ("Recipe notes: first preheat the oven, then mix flour, sugar, butter and two eggs in a "
          "large bowl until smooth; pour the batter into a greased tin and bake for forty minutes "
          "until golden. While it cools, prepare the icing by whisking")
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def offload_llm():
    llm = LLM(**SMALL_CACHE, enable_sleep_mode=True, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 64},
    })
    yield llm
    llm.llm_engine.shutdown()


def _stats(llm):
    return llm.llm_engine.engine_core.get_stats()


def test_evicted_prefix_is_served_from_host(offload_llm, bundled_llm):
    llm = offload_llm
    tok = llm.get_tokenizer()
    assert len(tok.encode(LONG_A)) > 2 * 16 and len(tok.encode(LONG_B)) > 2 * 16
    reference = [o.outputs[0].text for o in bundled_llm.generate([LONG_A, LONG_B], GREEDY)]

    first_a = llm.generate([LONG_A], GREEDY)[0].outputs[0].text
    before = _stats(llm)
    b = llm.generate([LONG_B], GREEDY)[0].outputs[0].text  # evicts A's blocks on the device
    after_b = _stats(llm)
    assert after_b.external_prefix_cache_hits == before.external_prefix_cache_hits
    again_a = llm.generate([LONG_A], GREEDY)[0]
    after = _stats(llm)

    hit = after.external_prefix_cache_hits - after_b.external_prefix_cache_hits
    num_prompt = len(again_a.prompt_token_ids)
    # Every full block of A but the one holding the last prompt token came from host.
    assert hit == (num_prompt - 1) // 16 * 16
    assert after.prefix_cache_hits == after_b.prefix_cache_hits  # nothing left on the device
    assert [first_a, b, again_a.outputs[0].text] == [reference[0], reference[1], reference[0]]
    assert again_a.num_cached_tokens == hit


def test_registered_after_the_extend(offload_llm):
    """The worker side saw the final cache only: its regions span every committed block."""
    worker = offload_llm.llm_engine.engine_core.worker
    kv = worker.kv_cache
    regions = worker.kv_connector.connector.registered_regions
    assert kv.committed_blocks == 5  # warmup committed 2; the extend made it 5
    assert regions == kv.committed_spans()
    assert len(regions) == 30 and all(n == 5 * BLOCK_BYTES // 30 for _, n in regions)


def test_sleep_forgets_the_host_copies_and_the_woken_engine_offloads_again(offload_llm,
                                                                           bundled_llm):
    """Sleep with a connector (#13 item 4): the host index is emptied with the prefix
    cache (the weights may change while asleep), the woken cache is registered again,
    and offload works as before: outputs equal recomputation."""
    llm = offload_llm
    reference = [o.outputs[0].text for o in bundled_llm.generate([LONG_A, LONG_B], GREEDY)]
    llm.generate([LONG_A], GREEDY)
    connector = llm.llm_engine.engine_core.scheduler.connector
    assert connector.host_index
    llm.sleep(level=1)
    assert not connector.host_index
    assert sorted(connector.free_slots) == list(range(connector.num_cpu_blocks))
    llm.wake_up()
    worker = llm.llm_engine.engine_core.worker
    assert worker.kv_connector.connector.registered_regions == worker.kv_cache.committed_spans()
    before = _stats(llm)
    texts = [llm.generate([p], GREEDY)[0].outputs[0].text for p in (LONG_A, LONG_B)]
    after_b = _stats(llm)
    assert after_b.external_prefix_cache_hits == before.external_prefix_cache_hits  # forgotten
    again = llm.generate([LONG_A], GREEDY)[0].outputs[0].text  # stored again after the wake
    assert _stats(llm).external_prefix_cache_hits > after_b.external_prefix_cache_hits
    assert [*texts, again] == [reference[0], reference[1], reference[0]]
