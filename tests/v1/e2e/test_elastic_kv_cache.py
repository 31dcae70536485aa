"""The elastic KV cache on real host pages: it follows the load up and back down (issue #18).

The bundled model (SmolLM2-135M, fp32): 30 layers of 24 KiB blocks; a 2 MiB
host granule per layer holds 85 blocks. The engine starts with the floor (one
max_model_len request: 17 blocks, filling one granule per layer = 85 blocks,
60 MiB), grows under a burst of 16 requests and returns to the floor when idle
(`VLLM_ELASTIC_KV_SHRINK_DELAY_S=0`).
"""

from __future__ import annotations

import functools
import gc
import time

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.core.elastic_sharing import DeviceShare, DeviceSharing
from vllm.v1.engine.elastic_kv import HOLD_AFTER_GIVING_S

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


def _elastic_engine(**extra):
    """The bundled model with the elastic cache, its shrink delay 0, shut down after."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ELASTIC_KV_SHRINK_DELAY_S", "0")
    engine = LLM(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512,
                 kv_cache_memory_bytes=256 * MiB, enable_elastic_kv_cache=True, **extra)
    yield engine
    engine.llm_engine.shutdown()
    mp.undo()
    gc.collect()


@pytest.fixture(scope="module")
def elastic_llm():
    yield from _elastic_engine(enable_sleep_mode=True)


@pytest.fixture(scope="module")
def async_elastic_llm(elastic_llm):
    """The same engine with async scheduling (the CUDA default): a step is in flight
    whenever the elastic cache adjusts."""
    yield from _elastic_engine(async_scheduling=True)


def _texts(llm: LLM) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _idle_until_floor(llm: LLM, core) -> None:
    for _ in range(20):
        llm.llm_engine.engine_core.adjust_kv_cache()
        if core.num_blocks == core.scheduler.elastic.floor:
            return


def test_committed_bytes_and_rss_follow_the_load_up_and_down(elastic_llm, offline_llm):
    core = elastic_llm.llm_engine.engine_core
    kv_cache = core.worker.kv_cache
    floor = core.scheduler.elastic.floor
    assert floor == kv_cache.committed_blocks == core.num_blocks == 85
    assert kv_cache.committed_bytes == 60 * MiB
    # Record every resize on the worker: (blocks, bytes, RSS) before and after.
    worker, trace = core.worker, []

    def traced(fn):
        @functools.wraps(fn)  # keeps its @rpc mark: the engine may still call it
        def call(num_blocks):
            before = (kv_cache.committed_blocks, kv_cache.committed_bytes, _rss())
            out = fn(num_blocks)
            trace.append((before, (kv_cache.committed_blocks, kv_cache.committed_bytes, _rss())))
            return out
        return call

    # Growth runs on the worker's helper thread (grow_kv_cache_ahead): trace the commit
    # itself there.
    kv_cache.extend_kv_cache = traced(kv_cache.extend_kv_cache)
    worker.shrink_kv_cache = traced(worker.shrink_kv_cache)
    # And how many prefix-cache entries each shrink of the block pool evicted.
    pool = core.scheduler.kv_cache_manager.block_pool
    resize, evicted = core.scheduler.resize_kv_cache, []

    def traced_resize(num_blocks, boundaries=()):
        cached = len(pool.cached_block_hash_to_block)
        resize(num_blocks, boundaries)
        evicted.append(cached - len(pool.cached_block_hash_to_block))

    core.scheduler.resize_kv_cache = traced_resize
    # No shrink during the burst, so the blocks above the floor end it holding
    # cached prompt blocks (the shrink after it must evict them).
    core.scheduler.elastic.shrink_delay_s = 1e9
    texts = _texts(elastic_llm)  # 16 prompts of ~120 tokens: ~150 blocks in flight, 84 committed
    grows = [(a, b) for a, b in trace if b[0] > a[0]]
    assert grows and core.scheduler.elastic.num_grows == len(grows)
    assert max(b[0] for _, b in grows) > floor
    for a, b in grows:  # host commits are resident at once
        assert b[2] - a[2] >= 0.8 * (b[1] - a[1])
    assert texts == _texts(offline_llm)  # identical to the non-elastic engine (greedy, fp32)

    core.scheduler.elastic.shrink_delay_s = 0.0
    _idle_until_floor(elastic_llm, core)
    assert core.num_blocks == kv_cache.committed_blocks == floor
    assert kv_cache.committed_bytes == 60 * MiB
    assert core.scheduler.elastic.num_shrinks >= 1
    shrinks = [(a, b) for a, b in trace if b[0] < a[0]]
    # Each counted shrink released whole driver allocations (issue #48: the counter read
    # 5 after 3 releases, when shrinks could stop inside a growth and free nothing).
    assert all(b[1] < a[1] for a, b in shrinks)
    assert core.scheduler.elastic.num_shrinks == len(shrinks)
    for a, b in shrinks:  # the pages really left
        assert a[2] - b[2] >= 0.8 * (a[1] - b[1])
    memory = core.kv_cache_memory()
    # /metrics' figures: the floor's blocks' bytes (the unit of the limit and of kv-top),
    # and the device's whole granules.
    assert memory.committed_bytes == floor * ekv_block_bytes(core) and memory.num_shrinks >= 1
    assert memory.physical_bytes == 60 * MiB

    # The shrink evicted cached prefix blocks above the floor; the same prompts
    # again hit only what survived and still give the same text.
    assert sum(evicted) > 0
    hits_before = core.get_stats().prefix_cache_hits
    assert _texts(elastic_llm) == texts
    assert core.get_stats().prefix_cache_hits > hits_before  # survivors were reused


def test_a_runtime_limit_caps_growth_and_releases_blocks_above_it(elastic_llm):
    core = elastic_llm.llm_engine.engine_core
    # In blocks' bytes (30 segments of 24 KiB a block), rounded down: 85 blocks, the floor.
    assert elastic_llm.llm_engine.set_kv_cache_limit(86 * 30 * 24 * 1024 - 1) == 85
    assert core.scheduler.max_num_blocks == 85
    elastic_llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # queues instead of growing
    assert core.num_blocks == 85 and core.worker.kv_cache.committed_bytes == 60 * MiB
    assert elastic_llm.llm_engine.set_kv_cache_limit(None) == 341  # the start-up limit back
    with pytest.raises(ValueError, match=">= 0 bytes"):
        elastic_llm.llm_engine.set_kv_cache_limit(-1)
    for bad in (1.5, True, "1GiB"):  # 1.5 and True set the floor; "1GiB" was a TypeError
        with pytest.raises(ValueError, match="an int number of bytes"):
            elastic_llm.llm_engine.set_kv_cache_limit(bad)


def test_wake_under_pressure_commits_the_floor_and_grows_later(elastic_llm, monkeypatch):
    core = elastic_llm.llm_engine.engine_core
    worker, kv_cache = core.worker, core.worker.kv_cache
    elastic_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    core.elastic_kv.sharing.want(40)  # a demand in the registry when it falls asleep
    elastic_llm.sleep(level=1)
    assert kv_cache.committed_bytes == 0 and core.num_blocks == 85
    # The registry (kv-top, the peers) says what /metrics says: nothing held asleep
    # (it showed the 85 blocks of the floor), and it asks no peer for memory (a peer
    # holding more would have preempted requests for it).
    slot = _my_slot(core)
    assert (slot.committed, slot.in_use, slot.reclaimable, slot.wanted) == (0, 0, 0, 0)
    assert core.kv_cache_memory().committed_bytes == 0
    elastic_llm.wake_up(tags=["kv_cache"])  # the floor is mapped, the weights still sleep
    assert _my_slot(core).committed == 85 * core.elastic_kv.block_bytes
    elastic_llm.sleep(level=1)
    # Another process took the memory: only 100 MiB free now (less than the headroom).
    monkeypatch.setattr(worker.memory, "free_bytes", lambda: 100 * MiB)
    elastic_llm.wake_up()
    assert not elastic_llm.llm_engine.is_sleeping()
    assert core.num_blocks == kv_cache.committed_blocks == 85  # the floor, no failure
    assert kv_cache.committed_bytes == 60 * MiB
    assert _my_slot(core).committed == 85 * core.elastic_kv.block_bytes
    texts = [o.outputs[0].text for o in elastic_llm.generate(PROMPTS[:2], GREEDY,
                                                              use_tqdm=False)]
    assert core.num_blocks == 85  # served from the floor (queued, never grown)
    monkeypatch.undo()  # the memory came back: the next burst grows again
    grows = core.scheduler.elastic.num_grows
    assert [o.outputs[0].text for o in elastic_llm.generate(PROMPTS[:2], GREEDY,
                                                             use_tqdm=False)] == texts
    elastic_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert core.scheduler.elastic.num_grows > grows


def _peer(core) -> DeviceSharing:
    """Another engine's slot in this engine's device registry ("host" here, the GPU's
    UUID on a GPU)."""
    ekv = core.elastic_kv
    return DeviceSharing([DeviceShare(ekv.sharing.devices[0].key, ekv.block_bytes)], "peer")


def _my_slot(core):
    return core.elastic_kv.sharing.registries[0].own_slot()


def test_an_idle_engine_releases_for_a_peers_demand_at_once(elastic_llm):
    """Another engine on the device lacks memory: this one, idle with a grown cache,
    releases whole growths at the next adjust (no shrink timer), RSS falls, and the
    registry and kv_cache_memory() say so; the demand is answered once."""
    core = elastic_llm.llm_engine.engine_core
    ekv, kv_cache, policy = core.elastic_kv, core.worker.kv_cache, core.scheduler.elastic
    policy.shrink_delay_s = 1e9  # only the demand may release
    try:
        elastic_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        grown, floor = core.num_blocks, policy.floor
        core.adjust_kv_cache()  # idle, but no timed release
        assert grown > floor and core.num_blocks == grown
        ekv.publish(force=True)
        mine = _my_slot(core)
        assert mine.committed == grown * ekv.block_bytes and mine.in_use == 0
        assert mine.reclaimable == (grown - floor) * ekv.block_bytes
        peer = _peer(core)
        try:
            rss, committed = _rss(), kv_cache.committed_bytes
            peer.want(grown - floor)
            assert core.adjust_kv_cache()
            assert core.num_blocks == kv_cache.committed_blocks == floor
            assert kv_cache.committed_bytes == 60 * MiB
            assert rss - _rss() >= 0.8 * (committed - 60 * MiB)  # the pages left
            assert _my_slot(core).gave_bytes == (grown - floor) * ekv.block_bytes
            memory = core.kv_cache_memory()
            assert memory.num_reclaims == 1 and memory.reclaimable_bytes == 0
            assert memory.limit_bytes == policy.limit * ekv.block_bytes
            core.adjust_kv_cache()  # answered once: nothing more goes
            assert core.num_blocks == floor and core.kv_cache_memory().num_reclaims == 1
        finally:
            peer.close()
    finally:
        policy.shrink_delay_s = 0.0


def test_an_engine_that_cannot_grow_asks_its_peers_and_withdraws_when_it_grew(
        elastic_llm, monkeypatch):
    core = elastic_llm.llm_engine.engine_core
    worker = core.worker
    _idle_until_floor(elastic_llm, core)
    time.sleep(HOLD_AFTER_GIVING_S)  # it gave blocks in an earlier test: no growth before
    # Another process holds the memory: growth reaches nothing.
    monkeypatch.setattr(worker.memory, "free_bytes", lambda: 100 * MiB)
    ids = [f"r{i}" for i in range(8)]  # 8 x 16 blocks wanted, 84 free
    for request_id in ids:
        core.add_request(_request(request_id))
    core.adjust_kv_cache()
    wanted = _my_slot(core).wanted
    assert wanted > 0 and wanted % core.elastic_kv.block_bytes == 0
    monkeypatch.undo()  # the memory came back: it grows, and the demand goes
    core.adjust_kv_cache()
    assert _my_slot(core).wanted == 0
    core.abort_requests(ids)


@pytest.mark.parametrize("max_tokens, preempts", [(64, True), (24, False)])
def test_a_busy_engine_above_its_share_preempts_for_a_peer_holding_less(
        elastic_llm, max_tokens, preempts):
    """Reclaim by preemption (issue #49): this engine grew for a burst and every request
    still runs, so no free tail can go; a peer holding less lacks memory. It preempts
    (by recompute) the requests above a piece boundary at or above its fair share,
    releases the tail at once (no timer, no waiting for the decodes to end), and the
    preempted requests' outputs do not change. Only requests whose decode to go
    outweighs their recompute go (`worth_preempting_for_peer`): with 24 tokens to go
    after ~130-token prompts none does, and nothing is released."""
    core = elastic_llm.llm_engine.engine_core
    ekv, policy = core.elastic_kv, core.scheduler.elastic
    tokenizer = elastic_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in elastic_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    _idle_until_floor(elastic_llm, core)
    policy.shrink_delay_s = 1e9  # only the demand may release
    from vllm.v1.request import Request
    for i, p in enumerate(prompts):
        core.add_request(Request(request_id=f"p{i}", prompt_token_ids=p,
                                 sampling_params=params, eos_token_id=None))
    got: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}

    def step():
        for out in core.step():
            got[out.request_id] += out.new_token_ids

    peer = _peer(core)
    try:
        for _ in range(40):  # until it grew and every request runs
            if len(core.scheduler.running) == len(prompts) and core.num_blocks > policy.floor:
                break
            step()
        grown, preemptions = core.num_blocks, core.scheduler.num_preemptions
        assert core.scheduler.kv_cache_manager.num_free_tail_blocks() < grown - policy.floor
        ekv.publish(force=True)
        peer.want(grown)  # more than can go: this engine keeps its fair share
        if not preempts:
            assert not core.adjust_kv_cache() and core.num_blocks == grown
            assert core.scheduler.num_preemptions == preemptions
            peer.want(0)
            grown = 0
        else:
            assert core.adjust_kv_cache()
            core.adjust_kv_cache()  # with a step in flight (async) the pages go now
        if grown:
            released = grown - core.num_blocks
            assert released > 0 and core.worker.kv_cache.committed_blocks == core.num_blocks
            assert core.num_blocks >= grown // 2  # the midpoint of the two: its share
            assert core.scheduler.num_preemptions > preemptions
            assert _my_slot(core).gave_bytes == released * ekv.block_bytes
            # Its preempted requests wait, and memory is free, yet it does not take back
            # what it gave before the asker's next step can (HOLD_AFTER_GIVING_S).
            kept = core.num_blocks
            assert core.scheduler.waiting and not core.adjust_kv_cache()
            assert core.num_blocks == kept
            peer.want(0)
        policy.shrink_delay_s = 0.0
        for _ in range(200):
            if not core.scheduler.has_requests():
                break
            step()
    finally:
        peer.close()
        policy.shrink_delay_s = 0.0
    assert [got[f"p{i}"] for i in range(len(prompts))] == [list(t) for t in expected]


@pytest.mark.parametrize("engine", ["elastic_llm", "async_elastic_llm"])
def test_a_busy_engine_moves_its_tail_blocks_down_for_a_peer_without_preempting(
        engine, request):
    """Reclaim by moving blocks (issue #49): the requests still running hold blocks high in
    the grown cache, but few of them; for a peer's demand the engine copies those blocks
    below the floor (`move_blocks_below`, `Worker.move_kv_blocks`), releases the whole
    growth at once and preempts nobody; the moved requests' outputs equal those of the
    same steps without a peer (same batches, so also exact in bf16 on a GPU, with a step
    in flight under async scheduling). Before the move every request holding a tail block
    was preempted (99 of 113 on the H100). The idle timer releases the same way when no
    peer asks: the few requests left keep running from the blocks below."""
    elastic_llm = request.getfixturevalue(engine)
    core = elastic_llm.llm_engine.engine_core
    ekv, policy, kv = core.elastic_kv, core.scheduler.elastic, core.scheduler.kv_cache_manager
    tokenizer = elastic_llm.get_tokenizer()
    # 200 tokens each: 16 of them outgrow the floor on the CPU (85 blocks) and a GPU (170).
    prompts = [tokenizer.encode(p * 2)[:200] for p in PROMPTS]
    kept = [f"m{i}" for i in range(12, 16)]  # the last admitted: the highest blocks
    from vllm.v1.request import Request

    def run(peer: DeviceSharing | None, timer: bool = False) -> list[list[int]]:
        policy.shrink_delay_s = 0.0
        _idle_until_floor(elastic_llm, core)
        time.sleep(HOLD_AFTER_GIVING_S)  # it may have given blocks before: may grow again
        policy.shrink_delay_s = 1e9  # only the demand may release
        for i, p in enumerate(prompts):
            core.add_request(Request(request_id=f"m{i}", prompt_token_ids=p,
                                     sampling_params=GREEDY_LONG, eos_token_id=None))
        got: dict[str, list[int]] = {r: [] for r in kept}

        def step():
            for out in core.step():
                if out.request_id in got:
                    got[out.request_id] += out.new_token_ids

        for _ in range(40):  # until it grew and every request runs
            if len(core.scheduler.running) == len(prompts) and core.num_blocks > policy.floor:
                break
            step()
        core.abort_requests([f"m{i}" for i in range(12)])
        if peer is not None:
            grown, floor = core.num_blocks, policy.floor
            preemptions = core.scheduler.num_preemptions
            assert any(b >= floor for r in kept for b in kv.get_block_ids(r))
            assert kv.num_blocks_in_use() <= policy.in_use_budget(floor)  # they fit below
            ekv.publish(force=True)
            peer.want(grown - floor)
            assert core.adjust_kv_cache() and core.num_blocks == floor
            core.adjust_kv_cache()  # with a step in flight (async) the pages go now
            assert core.worker.kv_cache.committed_blocks == floor
            assert core.scheduler.num_preemptions == preemptions
            assert all(max(kv.get_block_ids(r)) < floor for r in kept)
            assert [r.request_id for r in core.scheduler.running] == kept
            assert _my_slot(core).gave_bytes == (grown - floor) * ekv.block_bytes
            peer.want(0)
        if timer:
            floor, preemptions = policy.floor, core.scheduler.num_preemptions
            assert any(b >= floor for r in kept for b in kv.get_block_ids(r))
            policy.shrink_delay_s = 0.0
            for _ in range(10):  # about a chunk each time, down to the floor
                core.adjust_kv_cache()
            assert core.num_blocks == core.worker.kv_cache.committed_blocks == floor
            assert core.scheduler.num_preemptions == preemptions
            assert all(max(kv.get_block_ids(r)) < floor for r in kept)
        for _ in range(100):
            if not core.has_unfinished_requests():
                break
            step()
        return [got[r] for r in kept]

    peer = _peer(core)
    try:
        expected = run(None)
        assert run(peer) == expected and all(len(t) == 24 for t in expected)
        assert run(None, timer=True) == expected
    finally:
        peer.close()
        policy.shrink_delay_s = 0.0


GREEDY_LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _request(request_id):
    from vllm.v1.request import Request
    tokens = list(range(1, 200)) * 4
    return Request(request_id=request_id, prompt_token_ids=tokens[:250],
                   sampling_params=SamplingParams(max_tokens=4), eos_token_id=None)


def test_async_scheduling_grows_while_a_step_is_in_flight(async_elastic_llm, offline_llm):
    # Async scheduling (the CUDA default) keeps a step in flight the whole time it
    # serves: the cache must grow then too (found on the H200: it never grew); a
    # shrink waits until no step is in flight, and happens once the engine idles.
    llm = async_elastic_llm
    core = llm.llm_engine.engine_core
    assert core.async_scheduling
    floor = core.scheduler.elastic.floor
    grows = core.scheduler.elastic.num_grows
    assert _texts(llm) == _texts(offline_llm)
    assert core.scheduler.elastic.num_grows > grows
    _idle_until_floor(llm, core)
    assert core.num_blocks == core.worker.kv_cache.committed_blocks == floor


def test_a_registry_file_of_another_version_leaves_sharing_off_not_the_engine(
        elastic_llm, tmp_path, monkeypatch, caplog):
    """/dev/shm/vllm-kv-host left by an engine of another layout (or any foreign bytes):
    the engine starts without the registry, timed release only, and says so in one
    warning. Start-up failed with an OSError traceback until the file was deleted."""
    import logging

    from vllm.v1.engine.elastic_kv import ElasticKVController

    (tmp_path / "vllm-kv-host").write_bytes(b"NOTAKVR9" + bytes(20_000))
    monkeypatch.setenv("VLLM_KV_REGISTRY_DIR", str(tmp_path))
    core = elastic_llm.llm_engine.engine_core
    with caplog.at_level(logging.WARNING):
        controller = ElasticKVController(core.scheduler, core.model_executor.collective_rpc,
                                         "probe", time.monotonic)
    assert controller.sharing is None
    assert "is not a KV registry of this version" in caplog.text
    assert "without the device registry" in caplog.text


def ekv_block_bytes(core) -> int:
    """Bytes of one KV block across the layer segments (summed over the ranks)."""
    return core.elastic_kv.block_bytes
