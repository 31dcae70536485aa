"""benchmark_elastic.py's traffic and report, without servers: the arrival patterns (who
gets which requests when), the duration rule of mode `alone`, the issue's targets, and
the CSV / plot of the sampled series. (`benchmark_elastic.py --smoke` runs the servers.)
"""

from __future__ import annotations

import csv
import importlib

import numpy as np
import pytest

from tests.entrypoints.openai.utils import REPO_ROOT
from vllm.benchmarks.serve_client import RequestResult


@pytest.fixture
def scripts(monkeypatch):
    """import_module over benchmarks/ as the scripts see it (their helpers beside them)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    return importlib.import_module


@pytest.fixture
def loads(scripts):
    return scripts("elastic_loads")


def test_switching_poisson_keeps_each_phase_at_its_rate(loads):
    rng = np.random.default_rng(0)
    times = loads.switching_poisson_times(3000, lambda p: 40.0 if p % 2 == 0 else 2.0, 1.0,
                                          rng)
    assert times == sorted(times) and len(times) == 3000
    phases = np.floor(np.asarray(times)).astype(int)
    high = np.sum(phases % 2 == 0)
    # 40 : 2 per phase pair -> 95.2 % of arrivals in high phases, ~42 per pair
    assert 0.93 < high / len(times) < 0.97
    assert 36 < len(times) / ((phases[-1] + 1) / 2) < 48


def test_alternating_bursts_rotate_across_the_engines(loads):
    load = loads.LOADS["decode-heavy"]
    plan = loads.make_plan(load, "alternating", 3, scale=0.5, bursts=4, phase_s=10.0)
    assert [list(w.streams) for w in plan] == [[0], [1], [2], [0]]
    for wave in plan:
        (arrivals,) = wave.streams.values()
        assert len(arrivals) == 128 and {a.at_s for a in arrivals} == {0.0}
        assert {a.max_tokens for a in arrivals} == {1024}
    assert plan[0].streams[0][0].prompt != plan[3].streams[0][0].prompt


def test_poisson_streams_peak_in_their_own_phases(loads):
    load = loads.LOADS["prefill-heavy"]
    (wave,) = loads.make_plan(load, "poisson", 2, scale=1.0, bursts=2, phase_s=10.0)
    assert sorted(wave.streams) == [0, 1]
    for i, arrivals in wave.streams.items():
        assert len(arrivals) == 192
        own = sum(int(a.at_s // 10.0) % 2 == i for a in arrivals)
        assert own / len(arrivals) > 0.8, (i, own)  # 8 req/s against 0.5 req/s
    again = loads.make_plan(load, "poisson", 2, scale=1.0, bursts=2, phase_s=10.0)
    assert [a.at_s for a in again[0].streams[1]] == [a.at_s for a in wave.streams[1]]


def test_an_unknown_pattern_is_refused(loads):
    with pytest.raises(ValueError, match="unknown pattern 'steady'"):
        loads.make_plan(loads.LOADS["decode-heavy"], "steady", 2, scale=1.0, bursts=2,
                        phase_s=1.0)


def test_duration_is_each_waves_slowest_engine_plus_the_gaps(loads):
    waves = [loads.WaveResult(duration_s={0: 3.0, 1: 5.0}), loads.WaveResult(duration_s={1: 2.0})]
    assert loads.plan_duration(waves, gap_s=4.0) == 5.0 + 2.0 + 4.0


def test_latency_figures_pool_the_requests(loads):
    ok = RequestResult(ok=True, ttft_s=0.1, itl_s=[0.01, 0.03], output_tokens=3)
    slow = RequestResult(ok=True, ttft_s=0.5, itl_s=[0.02], output_tokens=2)
    failed = RequestResult(ok=False, error="HTTP 400: too long")
    figures = loads.latency_figures([ok, slow, failed])
    assert figures["tokens_served"] == 5 and figures["failed_requests"] == 1
    assert figures["errors"] == ["HTTP 400: too long"]
    assert figures["ttft_ms_p50"] == pytest.approx(300.0)
    assert figures["itl_ms_p99"] == pytest.approx(29.8)


def test_per_request_rows_time_sends_from_the_waves_first(scripts, loads):
    bench = scripts("benchmark_elastic")
    a = [RequestResult(ok=True, start_s=100.0, ttft_s=0.25, e2e_s=3.0, output_tokens=8),
         RequestResult(ok=False, start_s=101.5, error="HTTP 400")]
    b = [RequestResult(ok=True, start_s=99.5, ttft_s=0.5, e2e_s=1.0, output_tokens=4)]
    waves = [loads.WaveResult({0: a, 1: b}), loads.WaveResult({1: b}),
             loads.WaveResult({0: a[:1]})]
    # Engines that ran together share the wave's clock (B sent first); wave indices
    # are the plan's, also for waves the engine sat out.
    assert bench.per_request(waves, 0) == [[0, 0.5, 250.0, 3.0, 8], [0, 2.0, -1, 0.0, 0],
                                           [2, 0.0, 250.0, 3.0, 8]]
    assert bench.per_request(waves, 1) == [[0, 0.0, 500.0, 1.0, 4], [1, 0.0, 500.0, 1.0, 4]]
    # Mode alone: each engine's runs had their own clocks.
    assert bench.per_request(waves[:1], 0, shared=False)[0][:2] == [0, 0.0]


def _summary(throughput: float, ttft_p99: float, captures: list[int]) -> dict:
    return {"output_throughput": throughput, "ttft_ms_p99": ttft_p99, "itl_ms_p99": 10.0,
            "ooms": 0, "graph_captures_per_engine": captures}


def test_targets_of_the_issue(scripts):
    bench = scripts("benchmark_elastic")
    modes = {"elastic": _summary(1300.0, 900.0, [1, 1]), "static": _summary(1000.0, 2000.0,
                                                                             [1, 1]),
             "alone": _summary(1400.0, 800.0, [1, 1])}
    out = bench.compare("decode-heavy", "poisson", modes)
    assert out["elastic_over_static"]["output_throughput"] == pytest.approx(1.3)
    assert out["elastic_over_alone"]["ttft_ms_p99"] == pytest.approx(900 / 800)
    assert all(out["targets"].values()), out["targets"]
    modes["elastic"] = _summary(1100.0, 1500.0, [1, 2])
    targets = bench.compare("decode-heavy", "poisson", modes)["targets"]
    assert targets == {"throughput_ge_static": True, "ttft_p99_le_static": True,
                       "zero_oom": True, "one_graph_capture_per_engine": False,
                       "ttft_p99_le_half_static": False, "throughput_ge_1_2x_static": False}
    # Other loads and patterns carry no 0.5x / 1.2x target; no graphs (CPU): None.
    modes["elastic"] = _summary(1100.0, 1500.0, [0, 0])
    targets = bench.compare("prefill-heavy", "alternating", modes)["targets"]
    assert "ttft_p99_le_half_static" not in targets
    assert targets["one_graph_capture_per_engine"] is None


def test_series_csv_and_plot(scripts, tmp_path):
    plot = scripts("elastic_plot")
    series = [{"t_s": t, "A_committed_bytes": (1 + t) * 2**30, "A_in_use_bytes": None,
               "A_reclaimable_bytes": None, "A_limit_bytes": None,
               "B_committed_bytes": 2**29, "B_in_use_bytes": 2**28, "B_reclaimable_bytes": 0,
               "B_limit_bytes": 2**31} for t in (0.0, 0.5, 1.0)]
    mode = {"series": series, "engines": {"A": {"shape": "llama3_8b"},
                                          "B": {"shape": "qwen2_5_0_5b"}}}
    experiments = [{"load": "decode-heavy", "pattern": "poisson",
                    "modes": {"elastic": mode, "static": mode}}]
    png = tmp_path / "p.png"
    made = plot.write_series(experiments, str(tmp_path / "s.csv"), str(png))
    rows = list(csv.DictReader((tmp_path / "s.csv").read_text().splitlines()))
    assert len(rows) == 2 * 3 * 2  # modes x samples x engines
    assert rows[2] == {"load": "decode-heavy", "pattern": "poisson", "mode": "elastic",
                       "t_s": "0.5", "engine": "A", "committed_gib": "1.5", "in_use_gib": "",
                       "reclaimable_gib": "", "limit_gib": ""}
    assert rows[1]["limit_gib"] == "2.0" and rows[1]["in_use_gib"] == "0.25"
    if made == str(png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "CSV only" in made


@pytest.mark.parametrize(("free_gib", "fraction"), [(78, 58 / 80), (50, 1.0)])
def test_ballast_emulates_a_smaller_device(scripts, monkeypatch, tmp_path, free_gib, fraction):
    """--device-gib's ballast process, its torch replaced by one that reports a device of
    80 GiB with `free_gib` free: it holds free - 58 GiB (nothing on a smaller device)."""
    (tmp_path / "torch.py").write_text(
        "import types\nuint8 = None\n"
        f"cuda = types.SimpleNamespace(mem_get_info=lambda: ({free_gib} * 2**30, 80 * 2**30))\n"
        "def empty(n, dtype, device):\n    return bytearray(0)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    bench = scripts("benchmark_elastic")
    ballast = bench.Ballast(58.0)
    try:
        assert ballast.fraction == pytest.approx(fraction)
        assert ballast.line.startswith(f"ballast {max(free_gib - 58, 0):.2f} GiB held")
        if free_gib > 58:
            assert ballast.proc.poll() is None  # it holds while it lives
        else:
            assert ballast.proc.wait(timeout=60) == 0  # nothing to hold
    finally:
        ballast.stop()
    # The servers size against the emulated device (its 2 % elastic headroom was 2 % of
    # the card), so the modes' utilizations are shares of it, unscaled.
    args = bench.parse_args(["--shapes", "llama3_8b", "llama3_8b", "--device-gib", "58"])
    args.device_fraction = fraction
    assert bench._mode_flags("static", args) == ["--gpu-memory-utilization", "0.4500"]
    assert bench._mode_flags("alone", args) == []
    assert bench.server_env(args) == ({} if fraction == 1.0
                                      else {"VLLM_EMULATED_DEVICE_GIB": "58.0"})
