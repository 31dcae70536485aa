"""OffloadingConnector, bundled model: a prefix evicted from the KV cache comes back from host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from tests.v1.core.fake_runner import (
    FakeRunner,
    make_request,
    make_scheduler,
    next_token,
    run_until_done,
)
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

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
    connector = llm.llm_engine.engine_core.connector  # the scheduler-side connector
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


# A prefix partly in the device cache, the rest on the host (a user's report: greedy outputs
# changed with the connector). 20 blocks (19 usable); a ~200-token document takes 13, so
# the next document evicts the tail of the previous one (freed tail first): coming back,
# its head is a prefix-cache hit and its tail is loaded from host.
MIXED_CACHE = dict(ENGINE_KWARGS, max_num_seqs=8, kv_cache_memory_bytes=20 * BLOCK_BYTES,
                   max_model_len=256)


def _document(k: int) -> str:
    return f"Document {k}: " + " ".join(f"item{k}_{i}" for i in range(40))


@pytest.fixture(scope="module")
def mixed_llm():
    llm = LLM(**MIXED_CACHE, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 64},
    })
    yield llm
    llm.llm_engine.shutdown()


def test_local_hit_then_host_blocks_load_after_the_hit(mixed_llm, bundled_llm):
    """The user's order (1,2,3,4,1,2,1,3,1,3): greedy outputs equal an engine without the
    connector, including the requests whose head hit the prefix cache and whose tail came
    from host (the host blocks go into the blocks after the hit, not over the hit)."""
    llm = mixed_llm
    docs = {k: _document(k) for k in (1, 2, 3, 4)}
    tok = llm.get_tokenizer()
    assert all(160 < len(tok.encode(p)) < 240 for p in docs.values())
    reference = {k: bundled_llm.generate([p], GREEDY)[0].outputs[0].text
                 for k, p in docs.items()}
    got, mixed = [], 0
    for k in (1, 2, 3, 4, 1, 2, 1, 3, 1, 3):
        before = _stats(llm).prompt_tokens_by_source
        got.append((k, llm.generate([docs[k]], GREEDY)[0].outputs[0].text))
        after = _stats(llm).prompt_tokens_by_source
        local = after["local_cache_hit"] - before["local_cache_hit"]
        external = after["external_kv_transfer"] - before["external_kv_transfer"]
        assert local % 16 == 0 and external % 16 == 0
        mixed += bool(local and external)
    assert mixed >= 1  # the case of the report was exercised
    assert got == [(k, reference[k]) for k, _ in got]


def test_prompt_of_whole_blocks_loads_whole_blocks(mixed_llm, bundled_llm):
    """A prompt of exactly 6 blocks, again: its last token must be computed, so the host
    serves whole blocks short of the last one (never 15 tokens of a block it does not load)."""
    llm = mixed_llm
    ids = llm.get_tokenizer().encode(LONG_A + " " + LONG_B)[:96]
    prompt = {"prompt_token_ids": ids}
    reference = bundled_llm.generate([prompt], GREEDY)[0].outputs[0].text
    texts = []
    for _ in range(2):
        before = _stats(llm)
        out = llm.generate([prompt], GREEDY)[0]
        after = _stats(llm)
        texts.append(out.outputs[0].text)
        assert out.num_cached_tokens % 16 == 0
        assert (after.external_prefix_cache_hits - before.external_prefix_cache_hits) % 16 == 0
    assert texts == [reference, reference]


# ---- the scheduler side against a simulated host copy (torch-free, fast) ----


class _HostRunner(FakeRunner):
    """FakeRunner plus the worker side's copies: loads before the forward, stores after.

    FakeRunner checks every position a request attends to, so a load into the wrong
    block, from the wrong slot, or a store of unwritten KV fails at that step.
    """

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.host: dict[int, list[int | None]] = {}  # slot -> one entry per offset
        self.num_loaded = 0

    def execute_model(self, so):
        meta = so.kv_connector_metadata
        assert len({s for _, s in meta.stores}) == len(meta.stores), "a slot stored twice"
        for block_id, slot in meta.loads:
            for off, entry in enumerate(self.host.get(slot, [None] * self.block_size)):
                self.kv[(block_id, off)] = entry
        self.num_loaded += len(meta.loads)
        out = super().execute_model(so)
        for block_id, slot in meta.stores:
            self.host[slot] = [self.kv.get((block_id, off)) for off in range(self.block_size)]
        return out


def _offload_scheduler(num_cpu_blocks: int, **overrides):
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        cache_config=SimpleNamespace(block_size=4),
    )
    connector = OffloadingConnector(config, KVConnectorRole.SCHEDULER)
    connector.set_xfer_handshake_metadata({"num_cpu_blocks": num_cpu_blocks})
    return make_scheduler(connector=connector, **overrides)


def _doc(k: int, n: int = 30) -> list[int]:
    return [5000 + k] + list(range(100 * k, 100 * k + n - 1))


def _expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


@pytest.mark.parametrize("num_cpu_blocks", [64, 3])
def test_fake_runner_sees_right_kv_after_hits_loads_and_preemptions(num_cpu_blocks):
    """The user's order at block size 4 on 12 blocks (a document takes 8 to 9, so the next
    one evicts the previous one's tail: its head hits the prefix cache, its tail comes from
    host), then prompts of whole blocks, then a batch that preempts. With 3 host slots one
    step stores more blocks than the host holds."""
    scheduler = _offload_scheduler(num_cpu_blocks, num_blocks=13, max_num_batched_tokens=16,
                                   max_model_len=48)
    runner = _HostRunner(4)
    runs = [(f"d{n}", _doc(k), 6) for n, k in enumerate((1, 2, 3, 4, 1, 2, 1, 3, 1, 3))]
    runs += [(f"w{n}", _doc(k, 32), 3) for n, k in enumerate((5, 5, 6, 5, 6))]  # 8 whole blocks
    mixed = 0
    for req_id, prompt, max_tokens in runs:  # one at a time, as the user sent them
        before = dict(scheduler.get_stats().prompt_tokens_by_source)
        scheduler.add_request(make_request(req_id, prompt, max_tokens=max_tokens))
        assert run_until_done(scheduler, runner).outputs[req_id] == _expected(prompt, max_tokens)
        after = scheduler.get_stats().prompt_tokens_by_source
        mixed += bool(after["local_cache_hit"] > before["local_cache_hit"]
                      and after["external_kv_transfer"] > before["external_kv_transfer"])
    batch = {f"p{n}": _doc(k) for n, k in enumerate((7, 8, 1, 9, 2, 10))}  # they do not fit
    for req_id, prompt in batch.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=12))
    result = run_until_done(scheduler, runner)
    assert result.outputs == {r: _expected(p, 12) for r, p in batch.items()}
    assert scheduler.num_preemptions > 0 and runner.num_loaded > 0
    if num_cpu_blocks == 64:
        assert mixed >= 1  # the report's case: a prefix-cache hit and host blocks after it
