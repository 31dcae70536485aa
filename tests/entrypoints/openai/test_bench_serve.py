"""`vllm bench serve` (issue 10, item 6): vLLM's flags, result block and flat JSON.

Runs against the session's shared server on the bundled model, with a few short
requests; flag errors are checked before any request (no server needed) and are
one line, exit status 2.
"""

from __future__ import annotations

import json
import math

import pytest

from vllm.benchmarks.datasets import custom_samples, random_samples, sharegpt_samples
from vllm.benchmarks.serve import calculate_metrics
from vllm.benchmarks.serve_client import RequestResult, _arrival_delays
from vllm.entrypoints.cli.main import main


def _strict_json(path):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.transformers_utils.config import get_bundled_model_path
    from vllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(get_bundled_model_path())


def test_result_block_and_json_are_vllms(server, tmp_path, capsys):
    out_json = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "3",
                 "--random-input-len", "8", "--random-output-len", "4", "--max-concurrency",
                 "2", "--ignore-eos", "--disable-tqdm", "--output-json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.index("Initial test run completed.") < out.index(
        "============ Serving Benchmark Result ============")
    for line in ("Successful requests:                     3 ",
                 "Failed requests:                         0 ",
                 "Maximum request concurrency:             2 ",
                 "Total input tokens:                      24 ",
                 "Total generated tokens:                  12 ",
                 "Peak output token throughput (tok/s):", "Total token throughput (tok/s):",
                 "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):"):
        assert line in out
    assert "Request rate configured" not in out and "E2EL" not in out  # not asked for
    result = _strict_json(out_json)
    assert (result["completed"], result["failed"]) == (3, 0)
    # Random prompts are token ids: the input length is exact.
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (24, 12)
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 2
    assert 1 <= result["max_concurrent_requests"] <= 2
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_itl_ms", "p99_e2el_ms"):
        assert result[key] > 0, key
    assert "ttfts" not in result and "errors" not in result  # only with --save-detailed


def test_save_result_detailed_with_rate_label_and_metadata(server, tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2",
                 "--random-input-len", "6", "--random-output-len", "3", "--ignore-eos",
                 "--request-rate", "50", "--label", "mine", "--metadata", "run=7",
                 "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90",
                 "--goodput", "e2el:600000", "--save-result", "--save-detailed",
                 "--result-dir", str(tmp_path / "res"), "--disable-tqdm"])
    out = capsys.readouterr().out
    assert code == 0
    for line in ("Request rate configured (RPS):           50.00", "Request goodput (req/s):",
                 "P50 TTFT (ms):", "P90 E2EL (ms):"):
        assert line in out
    assert "TPOT" not in out and "P99" not in out
    (path,) = (tmp_path / "res").iterdir()
    assert path.name.startswith("mine-50.0qps-SmolLM2-135M-Instruct-")
    result = _strict_json(path)
    assert result["run"] == "7" and result["request_rate"] == 50.0
    assert result["input_lens"] == [6, 6] and result["output_lens"] == [3, 3]
    assert len(result["ttfts"]) == 2 and [len(itl) for itl in result["itls"]] == [2, 2]
    assert result["errors"] == ["", ""] and all(result["generated_texts"])
    assert result["request_goodput"] == result["request_throughput"]  # a 10-minute SLO


def test_chat_backend_and_file_datasets(server, tmp_path, capsys):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Name one planet of the solar system."},
                           {"from": "gpt", "value": "Mars is one planet of the solar system."}]},
    ]))
    custom = tmp_path / "prompts.jsonl"
    custom.write_text('{"prompt": "Say hello."}\n\n{"prompt": "Count to three."}\n')
    base = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--disable-tqdm",
            "--output-len", "3", "--ignore-eos"]
    for extra in (["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt)],
                  ["--dataset-name", "custom", "--dataset-path", str(custom),
                   "--backend", "openai-chat", "--endpoint", "v1/chat/completions/"]):
        out_json = tmp_path / "r.json"
        assert main([*base, *extra, "--output-json", str(out_json)]) == 0
        result = _strict_json(out_json)
        assert result["completed"] == 2 and result["total_output_tokens"] == 6
        assert result["total_input_tokens"] > 2 * 4
    assert "Successful requests:                     2" in capsys.readouterr().out


def test_unknown_model_stops_at_the_test_request(server, capsys):
    code = main(["bench", "serve", "--base-url", server.url, "--model", "nosuchmodel",
                 "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "vllm bench serve: error: the initial test request failed (HTTP 404: ")
    assert "nosuchmodel" in err[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics: unknown metric foo"),
    (["--metric-percentiles", "0"], "--metric-percentiles must lie in (0, 100]"),
    (["--goodput", "itl:5"], "--goodput: unknown metric 'itl'"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"],
     "--backend openai-chat needs an endpoint ending in chat/completions"),
    (["--output-json", "{tmp}"], "is a directory; give a file name"),
    (["--metadata", "novalue", "--output-json", "{tmp}/r.json"],
     "--metadata expects KEY=VALUE"),
    (["--header", "X-A=\u00e9"], "--header X-A: HTTP headers take ASCII characters only"),
    (["--base-url", "http://127.0.0.1:1"], "--base-url names the server: --host and --port"),
    (["--host", "a:b:c"], "server URL 'http://a:b:c:1' is not valid"),
    # A flag that would have no effect is an error, not silently unused.
    (["--dataset-path", "{tmp}"], "--dataset-path is not read by --dataset-name random"),
    (["--dataset-name", "sharegpt", "--dataset-path", "x", "--random-output-len", "3"],
     "--random-output-len is a flag of --dataset-name random, not of sharegpt"),
    (["--custom-output-len", "3"], "--custom-output-len is a flag of --dataset-name custom"),
    (["--input-len", "5", "--random-input-len", "5"], "name the same length: give one"),
    (["--dataset-name", "custom", "--dataset-path", "{tmp}"], "is a directory, not a file"),
    (["--save-detailed"], "--save-detailed has no effect without --save-result, --append"),
    (["--result-dir", "{tmp}", "--output-json", "{tmp}/r.json"],
     "--result-dir has no effect without --save-result or --append-result"),
])
def test_bad_flags_fail_before_any_request(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    # Port 1: nothing listens there, so reaching the server would fail differently.
    assert main(["bench", "serve", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vllm bench serve: error: ")
    assert message in err[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--random-range-ratio", "1"], "argument --random-range-ratio: must be a number in [0, 1)"),
    (["--port", "70000"], "argument --port: must be a port number <= 65535"),
    (["--extra-body", "[1]"], "argument --extra-body: must be a JSON object"),
    (["--dataset-name", "sonnet"], "argument --dataset-name: invalid choice"),
])
def test_bad_flag_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    from vllm.benchmarks import serve

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "main", interrupted)
    assert main(["bench", "serve", "--disable-tqdm"]) == 130
    assert capsys.readouterr().err == "vllm bench serve: interrupted\n"


def _result(start, ttft, itls, tokens):
    return RequestResult(ok=True, start_s=start, ttft_s=ttft, itl_s=itls,
                         e2e_s=ttft + sum(itls), output_tokens=tokens, prompt_tokens=5)


def test_metrics_follow_vllms_definitions():
    results = [_result(0.0, 0.1, [0.05, 0.05], 3), _result(0.1, 0.3, [0.1], 2),
               RequestResult(ok=False, error="HTTP 400: bad")]
    samples = [None, None, None]
    m = calculate_metrics(results, 2.0, samples, [50.0, 99.0], {"ttft": 200.0}, start=0.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (10, 5)
    assert m["request_throughput"] == 1.0 and m["total_token_throughput"] == 7.5
    assert m["request_goodput"] == 0.5  # only the first meets TTFT <= 200 ms
    assert math.isclose(m["mean_ttft_ms"], 200.0)
    assert math.isclose(m["mean_tpot_ms"], (50.0 + 100.0) / 2)  # (e2e - ttft) / (tokens - 1)
    assert math.isclose(m["median_itl_ms"], 50.0) and math.isclose(m["p99_e2el_ms"], 398.0)
    assert m["max_concurrent_requests"] == 2 and m["max_output_tokens_per_s"] == 5.0
    empty = calculate_metrics([RequestResult(ok=False)], 1.0, [None], [99.0], {}, start=0.0)
    assert empty["mean_ttft_ms"] == 0.0 and empty["p99_itl_ms"] == 0.0  # no NaN
    assert empty["request_goodput"] is None


def test_back_to_back_requests_are_not_counted_concurrent():
    results = [_result(0.0, 0.5, [], 1), _result(0.5, 0.5, [], 1)]
    assert calculate_metrics(results, 1.0, [None, None], [99.0], {},
                             start=0.0)["max_concurrent_requests"] == 1


def test_arrivals_have_the_requested_rate():
    times = _arrival_delays(4000, 20.0, seed=1, burstiness=0.5)
    assert times[0] == 0.0 and times == sorted(times)  # the first is sent at once
    assert math.isclose(times[-1] / 3999, 1 / 20.0, rel_tol=0.1)
    assert _arrival_delays(3, float("inf"), seed=1) == [0.0, 0.0, 0.0]


def test_random_samples_lengths_prefix_and_no_special_tokens(tokenizer):
    samples = random_samples(tokenizer, 50, 20, 10, range_ratio=0.5, prefix_len=4, seed=3)
    special = set(tokenizer.all_special_ids)
    assert all(s.prompt[:4] == samples[0].prompt[:4] for s in samples)
    assert all(4 + 10 <= s.prompt_len == len(s.prompt) <= 4 + 30 for s in samples)
    assert all(5 <= s.expected_output_len <= 15 for s in samples)
    assert not special & {t for s in samples for t in s.prompt}
    assert random_samples(tokenizer, 2, 5, 3, seed=3) == random_samples(tokenizer, 2, 5, 3,
                                                                          seed=3)


def test_file_datasets_filter_and_report_bad_files(tokenizer, tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Hi"},  # under 4 tokens: skipped
                           {"from": "gpt", "value": "Hello, how can I help you today?"}]},
        {"conversations": [{"from": "human", "value": "Tell me a fact about the sea."},
                           {"from": "gpt", "value": "The sea covers most of the Earth."}]},
        {"conversations": []},
    ]))
    samples = sharegpt_samples(str(path), tokenizer, 3, None)
    assert [s.prompt for s in samples] == ["Tell me a fact about the sea."] * 3
    assert samples[0].expected_output_len == len(
        tokenizer("The sea covers most of the Earth.").input_ids)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object with a 'prompt'"):
        custom_samples(str(bad), tokenizer, 2, 8)
    path.write_text("not json")
    with pytest.raises(ValueError, match="is not a ShareGPT JSON file"):
        sharegpt_samples(str(path), tokenizer, 1, None)
