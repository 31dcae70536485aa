"""benchmarks/elastic_sim.py: the what-if model runs the real scheduler and elastic
controller to the end of a small load, and its modelled workers keep to the pool."""

from __future__ import annotations

import importlib
import os

import pytest

from tests.entrypoints.openai.utils import REPO_ROOT


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    return importlib.import_module("elastic_sim")


def test_modelled_workers_share_one_pool(sim):
    pool: dict[str, int] = {}
    device = sim.DeviceModel(pool_blocks=1000, floor_blocks=10, limit_blocks=900)
    a = sim.ModelledWorker(pool, 1000, "a", device)
    b = sim.ModelledWorker(pool, 1000, "b", device)
    from vllm.v1.worker.gpu_worker import Worker
    assert a.call(Worker.grow_kv_cache_ahead, (800,))[1]  # in flight: ends by the next call
    reached, in_flight, ends = a.call(Worker.grow_kv_cache_ahead, (800,))
    assert (reached, in_flight) == (800, False) and ends and max(ends) < 800
    assert b.call(Worker.grow_kv_cache, (900,))[0] == 1000 - 800  # what is left
    assert a.call(Worker.shrink_kv_cache, (5,)) == 10  # never below the floor
    assert b.call(Worker.grow_kv_cache, (900,))[0] == 900  # the limit
    assert sum(pool.values()) <= 1000


def test_modelled_workers_match_the_worker_functions_not_their_names(sim):
    """The controller passes `Worker.<method>`: a function that only shares a name, or a
    worker method the model lacks, is refused (a renamed worker method fails here)."""
    device = sim.DeviceModel(pool_blocks=1000, floor_blocks=10, limit_blocks=900)
    worker = sim.ModelledWorker({}, 1000, "a", device)
    from vllm.v1.worker.gpu_worker import Worker
    assert worker.call(Worker.kv_cache_device, ())[0] == "modelled-device"

    def kv_cache_device():
        pass

    with pytest.raises(NotImplementedError, match="kv_cache_device"):
        worker.call(kv_cache_device, ())
    with pytest.raises(NotImplementedError, match="Worker.set_kv_cache_limit"):
        worker.call(Worker.set_kv_cache_limit, (None,))


@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_every_request_of_a_small_load_finishes(sim, mode):
    r = sim.simulate(mode, scale=0.04, max_tokens=48, static_blocks=40,
                     device=sim.DeviceModel(pool_blocks=80, floor_blocks=8, limit_blocks=80))
    assert r["mode"] == mode and r["duration_s"] > 0
    assert r["output_throughput"] == pytest.approx(2 * 10 * 48 / r["duration_s"], rel=1e-3)
    assert 0 <= r["ttft_s_p50"] <= r["ttft_s_p99"]
    assert set(r["engines"]) == {"A", "B"}


def test_a_run_leaves_the_registry_setting_as_it_was(sim, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_KV_REGISTRY_DIR", str(tmp_path))
    sim.simulate("elastic", scale=0.02, max_tokens=8,
                 device=sim.DeviceModel(pool_blocks=80, floor_blocks=8, limit_blocks=80))
    from vllm import envs
    assert os.environ["VLLM_KV_REGISTRY_DIR"] == str(tmp_path)
    assert str(envs.VLLM_KV_REGISTRY_DIR) == str(tmp_path)
    assert not list(tmp_path.iterdir())  # its registry was elsewhere


def test_an_engine_answering_its_peer_leaves_short_replies_running(sim):
    """The prefill-heavy Poisson load at half scale (~2,900-token prompts, 128-token
    replies): answering the peer used to preempt ~40 requests for recompute (the H100:
    48 against static's 4, TTFT p99 1.54x static); only requests whose decode outweighs
    their recompute may go now (`worth_preempting_for_peer`)."""
    elastic = sim.simulate("elastic", "prefill-heavy", "poisson", 0.5)
    static = sim.simulate("static", "prefill-heavy", "poisson", 0.5)
    assert elastic["preemptions"] <= static["preemptions"] + 5, (elastic, static)
    assert elastic["ttft_s_p99"] <= static["ttft_s_p99"]
