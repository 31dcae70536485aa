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
