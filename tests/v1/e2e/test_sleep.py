"""Sleep mode over the VMM reservation (CPU: the host backend gives the same semantics)."""

from __future__ import annotations

import gc

import pytest

from vllm import LLM, SamplingParams
from vllm.device_allocator.vmm import VmmError
from vllm.exceptions import DeviceMemoryError
from vllm.v1.engine.exceptions import EngineSleepingError

PROMPTS = ["The capital of France is", "List three colors:"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)
LONG = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _texts(llm: LLM) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_sleep_mode=True,
        kv_cache_memory_bytes=256 << 20,
    )
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def reference(llm):
    return _texts(llm)


def test_level1_outputs_identical_and_kv_pages_released(llm, reference):
    # Touch KV pages (8 x ~80 tokens x 46 KiB per token ~ 29 MiB), then sleep.
    llm.generate(["Tell me a story about the sea."] * 8, LONG, use_tqdm=False)
    worker = llm.llm_engine.engine_core.worker
    kv_before = worker.kv_cache.committed_bytes
    rss_awake = _rss_mib()
    llm.sleep(level=1)
    assert llm.llm_engine.is_sleeping()
    assert worker.kv_cache.committed_bytes == 0 and worker.weight_arena.physical_bytes == 0
    assert rss_awake - _rss_mib() > 20  # the touched KV pages left (weights moved to a host copy)
    base = worker.kv_cache.tensor.base
    assert llm.llm_engine.wake_up() is False  # level 1 kept the weights: nothing to reload
    assert not llm.llm_engine.is_sleeping()
    assert worker.kv_cache.tensor.base == base
    assert worker.kv_cache.committed_bytes == kv_before
    assert _texts(llm) == reference


def test_level2_releases_weights_and_reload_restores_outputs(llm, reference):
    worker = llm.llm_engine.engine_core.worker
    weights = worker.weight_arena.nbytes
    rss_awake = _rss_mib()
    llm.sleep(level=2)
    assert rss_awake - _rss_mib() > 0.8 * weights / 2**20
    assert llm.llm_engine.wake_up() is True  # the weights must be reloaded
    # The offline engine leaves the reload to its caller, and refuses to generate with
    # the zero weights meanwhile (it returned empty text, silently).
    with pytest.raises(EngineSleepingError, match=r"sleep\(level=2\) and not loaded again: "
                       r"call reload_weights\(\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.reload_weights()
    assert _texts(llm) == reference


def test_requests_while_asleep_are_rejected(llm, reference):
    llm.sleep(level=1)
    try:
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.wake_up()
    assert _texts(llm) == reference


def test_prefix_cache_is_empty_after_wake(llm):
    prompt = "A long shared prefix that fills more than one block of sixteen tokens for sure. " * 2
    llm.generate([prompt], GREEDY, use_tqdm=False)
    hit = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    llm.sleep(level=1)
    llm.wake_up()
    miss = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert miss.num_cached_tokens == 0
    assert miss.outputs[0].text == hit.outputs[0].text


def test_ten_cycles_leave_no_growth(llm, reference):
    llm.sleep(level=1)
    llm.wake_up()
    start = _rss_mib()
    for _ in range(10):
        llm.sleep(level=1)
        llm.wake_up()
    assert _rss_mib() - start < 32
    assert _texts(llm) == reference


def test_failed_wake_stays_asleep_and_a_later_wake_succeeds(llm, reference, monkeypatch):
    worker = llm.llm_engine.engine_core.worker
    driver = worker.kv_cache.driver
    llm.sleep(level=1)
    real_create = driver.create
    calls = {"n": 0}

    def create_fails_once(size):
        calls["n"] += 1
        if calls["n"] == 1:
            raise VmmError(f"create({size}) failed: out of memory (another process took it)")
        return real_create(size)

    monkeypatch.setattr(driver, "create", create_fails_once)
    with pytest.raises(DeviceMemoryError, match=r"needs \d+\.\d+ GiB of device memory and "
                       r"\d+\.\d+ GiB is free \(create\(\d+\) failed: out of memory") as info:
        llm.wake_up(tags=["kv_cache"])
    assert info.value.needed_bytes == worker.kv_cache.released_bytes > 0
    assert llm.llm_engine.is_sleeping()
    assert worker.sleeping_tags() == ["weights", "kv_cache"]
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    assert _texts(llm) == reference


def test_level2_wake_failing_part_way_still_reloads_on_retry(llm, reference, monkeypatch):
    """The weights map, the KV cache's first map fails: the wake puts the weights back to
    sleep (the asleep footprint the 503 promises; they stayed mapped, engine-core RSS
    885 -> 1,399 MiB), and the retry that succeeds must still say the weights need
    loading (they are zero pages), not serve garbage."""
    worker = llm.llm_engine.engine_core.worker
    driver = worker.kv_cache.driver
    llm.sleep(level=2)
    real_map = driver.map
    calls = {"n": 0}

    def map_fails_after_one(va, size, handle):
        calls["n"] += 1
        if calls["n"] > 1:
            raise VmmError(f"map(size={size}) failed: out of memory (injected after 1 map)")
        return real_map(va, size, handle)

    monkeypatch.setattr(driver, "map", map_fails_after_one)
    with pytest.raises(DeviceMemoryError, match="injected after 1 map"):
        llm.llm_engine.wake_up()
    assert calls["n"] >= 2  # the weights' map went through, the KV cache's did not
    assert worker.sleeping_tags() == ["weights", "kv_cache"]  # both back asleep
    assert worker.weight_arena.physical_bytes == 0 == worker.kv_cache.committed_bytes
    monkeypatch.undo()
    assert llm.llm_engine.wake_up() is True
    assert llm.llm_engine.wake_up() is True  # until they are loaded, whoever asks
    llm.reload_weights()
    assert llm.llm_engine.wake_up() is False
    assert _texts(llm) == reference


def test_level1_wake_failing_part_way_keeps_the_weights_for_the_retry(llm, reference,
                                                                      monkeypatch):
    """Put back to sleep after a level-1 wake that mapped the weights: their host copy
    is taken again, so the retry restores the same outputs."""
    worker = llm.llm_engine.engine_core.worker
    driver = worker.kv_cache.driver
    llm.sleep(level=1)
    real_map = driver.map
    calls = {"n": 0}

    def map_fails_after_one(va, size, handle):
        calls["n"] += 1
        if calls["n"] > 1:
            raise VmmError(f"map(size={size}) failed: out of memory (injected after 1 map)")
        return real_map(va, size, handle)

    monkeypatch.setattr(driver, "map", map_fails_after_one)
    with pytest.raises(DeviceMemoryError, match="injected after 1 map"):
        llm.wake_up()
    assert worker.sleeping_tags() == ["weights", "kv_cache"]
    assert worker.weight_arena.physical_bytes == 0
    monkeypatch.undo()
    assert llm.llm_engine.wake_up() is False
    assert _texts(llm) == reference


def test_sleep_and_wake_log_one_line_each_with_sizes(llm, reference, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="vllm")
    worker = llm.llm_engine.engine_core.worker
    weights = worker.weight_arena.physical_bytes
    llm.sleep(level=1)
    llm.wake_up()
    sleeps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Sleep level")]
    wakes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Woke ")]
    assert len(sleeps) == 1 and len(wakes) == 1, (sleeps, wakes)
    assert f"released {weights / 2**30:.3f} GiB of weights (copied to host)" in sleeps[0]
    assert wakes[0].startswith("Woke weights and kv_cache: mapped ")
    assert "reloaded" not in wakes[0]
    assert _texts(llm) == reference


def test_sleep_needs_sleep_mode(bundled_llm):
    assert not bundled_llm.llm_engine.vllm_config.cache_config.enable_sleep_mode
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        bundled_llm.sleep(1)
    assert not bundled_llm.llm_engine.is_sleeping()
