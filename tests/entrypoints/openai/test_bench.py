"""`vllm bench latency|throughput|serve` (issue 10, item 6): vLLM's summary lines and JSON.

latency and throughput run on the session's shared offline engine (their `run`; `main`
only adds building the engine from the flags and shutting it down); serve's own tests
are in test_bench_serve.py. Flag errors are one line and exit status 2.
"""

from __future__ import annotations

import pytest

from vllm.entrypoints.cli.main import main, make_parser


def _args(*argv: str):
    return make_parser().parse_args(["bench", *argv])


def test_latency_prints_vllms_lines_and_fresh_prompts_per_iteration(bundled_llm, capsys):
    from vllm.benchmarks import latency

    result = latency.run(bundled_llm, _args("latency", "--input-len", "40", "--output-len", "3",
                                             "--batch-size", "2", "--num-iters-warmup", "1",
                                             "--num-iters", "2", "--disable-tqdm"))
    out = capsys.readouterr().out
    assert f"Avg latency: {result['avg_latency']} seconds" in out
    for pct in (10, 25, 50, 75, 90, 99):
        assert f"{pct}% percentile latency: " in out
    assert len(result["latencies"]) == 2 and set(result["percentiles"]) == {
        "10", "25", "50", "75", "90", "99"}
    for it in result["iterations"]:  # TTFT apart from decode; no prefix-cache hits
        assert it["output_tokens"] == 6 and it["decode_steps"] == 2
        assert it["prefix_cache_hit_tokens"] == 0
        assert 0 < it["ttft_s"] < it["total_s"]


def test_throughput_prints_vllms_lines(bundled_llm, capsys):
    from vllm.benchmarks import throughput

    result = throughput.run(bundled_llm, _args("throughput", "--input-len", "10",
                                               "--output-len", "2", "--num-prompts", "3",
                                               "--disable-tqdm"))
    out = capsys.readouterr().out
    assert result["num_requests"] == 3 and result["total_num_tokens"] == 3 * (10 + 2)
    assert (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s") in out
    assert "Total num prompt tokens:  30" in out and "Total num output tokens:  6" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["latency", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    (["throughput", "--num-prompts", "x"], "must be an integer >= 1, got 'x'"),
    (["serve", "--request-rate", "-1"], "argument --request-rate: must be a number > 0"),
])
def test_bad_flags_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and f"vllm bench {argv[0]}: error:" in err and "Traceback" not in err


def test_no_server_and_missing_model_are_one_line_errors(capsys, tmp_path):
    assert main(["bench", "serve", "--port", "1", "--disable-tqdm"]) == 2
    assert main(["bench", "latency", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("vllm bench serve: error: no server answers at http://127.0.0.1:1")
    assert err[1].startswith("vllm bench latency: error: model ")


def test_latency_shows_warmup_and_profiling_bars_apart(bundled_llm, capsys):
    """vLLM's two progress bars: "Warmup iterations" (untimed), then "Profiling iterations"."""
    from vllm.benchmarks import latency

    result = latency.run(bundled_llm, _args("latency", "--input-len", "6", "--output-len", "2",
                                             "--batch-size", "1", "--num-iters-warmup", "1",
                                             "--num-iters", "2"))
    err = capsys.readouterr().err
    assert len(result["latencies"]) == 2
    warmup, profiling = err.rindex("Warmup iterations: 100%"), err.rindex(
        "Profiling iterations: 100%")
    assert warmup < profiling and "| 1/1 " in err[warmup:profiling] and "| 2/2 " in err[profiling:]
    assert "Iterations:" not in err


class _FakeLLM:
    """Stands for `LLM` in `make_llm`: records its arguments, or raises `error`."""

    error: BaseException | None = None
    kwargs: dict = {}

    def __init__(self, **kwargs):
        if _FakeLLM.error is not None:
            raise _FakeLLM.error
        _FakeLLM.kwargs = kwargs


@pytest.fixture
def fake_llm(monkeypatch):
    monkeypatch.setattr("vllm.entrypoints.llm.LLM", _FakeLLM)
    _FakeLLM.error, _FakeLLM.kwargs = None, {}
    return _FakeLLM


def test_latency_keeps_the_engines_max_num_seqs_unless_the_batch_needs_more(fake_llm):
    from vllm.benchmarks.offline import make_llm
    from vllm.config.scheduler import default_limits
    from vllm.platforms import current_platform

    default = default_limits(current_platform.device_type)[0]  # 64 on CPU, 256 on CUDA
    for flags, max_num_seqs in [
        ([str(default)], None),  # the engine's default holds the batch: left unset
        ([str(default + 1)], default + 1),  # the batch needs more: runs as one
        ([str(default + 1), "--max-num-seqs", "8"], 8),  # the user's value stays
    ]:
        args = _args("latency", "--batch-size", *flags)
        make_llm(args, max_num_seqs_at_least=args.batch_size)
        assert fake_llm.kwargs["max_num_seqs"] == max_num_seqs, flags


@pytest.mark.parametrize(("kind", "error", "code"), [
    ("latency", "KVCacheSizingError", 1),
    ("throughput", "KVCacheSizingError", 1),
    ("latency", "DeviceBusyError", 1),
    ("throughput", "ValueError", 2),
])
def test_engine_start_up_refusals_are_one_line_with_serves_exit_code(
        fake_llm, capsys, kind, error, code):
    """What `vllm serve` reports in one line at engine start-up (test_cli: exit 1 for a KV
    cache the device cannot hold or a busy device, 2 for a value the engine refuses) ends
    `vllm bench latency|throughput` the same way, without a traceback."""
    from vllm.exceptions import DeviceBusyError
    from vllm.v1.worker.kv_cache_sizing import KVCacheSizingError

    errors = {"KVCacheSizingError": KVCacheSizingError, "DeviceBusyError": DeviceBusyError,
              "ValueError": ValueError}
    fake_llm.error = errors[error]("the device is too small for even one KV cache block")
    assert main(["bench", kind]) == code
    assert capsys.readouterr().err == (
        f"vllm bench {kind}: error: the device is too small for even one KV cache block\n")


def test_other_engine_errors_are_not_swallowed(fake_llm):
    fake_llm.error = RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench", "latency"])


@pytest.mark.parametrize("kind", ["latency", "throughput"])
def test_an_output_path_that_is_a_directory_fails_before_the_engine(fake_llm, tmp_path,
                                                                    capsys, kind):
    assert main(["bench", kind, "--output-json", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"vllm bench {kind}: error: output path {str(tmp_path)!r} is a directory; "
        "give a file name\n")
    assert fake_llm.kwargs == {}  # no engine was built


def test_a_json_that_cannot_be_written_after_the_run_is_one_line(fake_llm, monkeypatch,
                                                                 tmp_path, capsys):
    """The path passed the check, then became a directory during the run."""
    from vllm.benchmarks import latency

    out = tmp_path / "lat.json"

    class Engine:
        def shutdown(self):
            pass

    def run(llm, args):
        out.mkdir()
        return {"avg_latency": 1.0}

    monkeypatch.setattr(_FakeLLM, "llm_engine", Engine(), raising=False)
    monkeypatch.setattr(latency, "run", run)
    assert main(["bench", "latency", "--output-json", str(out)]) == 2
    assert capsys.readouterr().err == f"vllm bench latency: error: Is a directory ({out})\n"
