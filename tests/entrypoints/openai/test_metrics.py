"""GET /metrics: vLLM's names, parsable by prometheus-client, counters that follow the
requests, and blocks that return to the pool when a client disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.utils import MODEL_NAME, scrape_metrics

pytestmark = pytest.mark.slow  # a real engine on the bundled model

REQUIRED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:kv_cache_committed_bytes",
    "vllm:kv_cache_reserved_bytes",
    "vllm:kv_cache_num_blocks",
]
SUCCESS_LENGTH = "vllm:request_success_total{finished_reason=length}"
SUCCESS_ABORT = "vllm:request_success_total{finished_reason=abort}"
# Long enough to fill two 16-token blocks, so a repeat hits the prefix cache.
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog while the farmer watches from "
               "the porch and the sun sets slowly behind the distant hills of the valley.")


def _wait_for(server, predicate, timeout: float = 10.0) -> dict[str, float]:
    """Scrape until `predicate(metrics)` holds (stats land right after the step that made
    them, a moment after the client already has its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape_metrics(server)
        if predicate(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def _complete(server, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra}
    response = httpx.post(server.url_for("v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_names_parse_and_memory_gauges(server):
    _complete(server, "Hello", 2)
    metrics = scrape_metrics(server)
    missing = [name for name in REQUIRED if name not in metrics]
    assert not missing, missing
    committed = metrics["vllm:kv_cache_committed_bytes"]
    reserved = metrics["vllm:kv_cache_reserved_bytes"]
    assert 0 < committed <= reserved
    # A fixed cache (no --enable-elastic-kv-cache): its limit is its size, not 0, so in
    # use <= committed <= limit holds as with the elastic cache.
    assert metrics["vllm:kv_cache_limit_bytes"] == committed
    assert 0 <= metrics["vllm:kv_cache_in_use_bytes"] <= committed
    assert metrics["vllm:kv_cache_num_blocks"] > 1
    assert 0.0 <= metrics["vllm:kv_cache_usage_perc"] <= 1.0


def test_counters_follow_requests(server):
    before = scrape_metrics(server)
    usage = _complete(server, LONG_PROMPT, 5, ignore_eos=True)["usage"]
    expected_prompt = before["vllm:prompt_tokens_total"] + usage["prompt_tokens"]
    after = _wait_for(server, lambda m: m["vllm:prompt_tokens_total"] >= expected_prompt
                      and m.get(SUCCESS_LENGTH, 0) > before.get(SUCCESS_LENGTH, 0))
    assert usage["completion_tokens"] == 5
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == (
        usage["prompt_tokens"])
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after[SUCCESS_LENGTH] - before.get(SUCCESS_LENGTH, 0) == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        name = f"vllm:{histogram}_count"
        assert after[name] - before[name] == 1, name
    itl = "vllm:inter_token_latency_seconds_count"
    assert after[itl] - before[itl] == 4  # 5 tokens, 4 gaps
    queries = "vllm:prefix_cache_queries_total"
    assert after[queries] > before[queries]
    # The same prompt again: its full blocks come from the prefix cache.
    _complete(server, LONG_PROMPT, 1)
    hits = "vllm:prefix_cache_hits_total"
    again = _wait_for(server, lambda m: m[hits] > after[hits])
    assert again[hits] - after[hits] >= 16


def _held(metrics: dict[str, float]) -> bool:
    return metrics["vllm:num_requests_running"] > 0 and metrics["vllm:kv_cache_usage_perc"] > 0


def _released(metrics: dict[str, float]) -> bool:
    return (metrics["vllm:num_requests_running"] == 0
            and metrics["vllm:num_requests_waiting"] == 0
            and metrics["vllm:kv_cache_usage_perc"] == 0)


def test_disconnect_mid_stream_returns_blocks(server):
    max_tokens = 400
    before = _wait_for(server, _released)
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url_for("v1/completions"), json=body,
                      timeout=120) as response:
        # Hold one iterator over the stream and never leave it with `break`: leaving a
        # `for` over iter_lines() closes the generator, and with it the connection, so the
        # server would (rightly) abort the request while the scrape below still runs.
        lines = response.iter_lines()
        received = []
        while len(received) < 3:
            line = next(lines)
            if line.startswith("data: "):
                received.append(json.loads(line.removeprefix("data: ")))
        # The stream is still open and unread: the request runs (or waits on the
        # socket's back-pressure) and holds its blocks until the client leaves.
        during = _wait_for(server, _held)
        assert _held(during), during
    # The connection is closed: the server must abort the request and free its blocks,
    # and count it as finished with reason "abort" (as vLLM does), with its latency.
    after = _wait_for(server, lambda m: _released(m)
                      and m[SUCCESS_ABORT] > before[SUCCESS_ABORT])
    assert _released(after), after
    assert after[SUCCESS_ABORT] - before[SUCCESS_ABORT] == 1
    e2e = "vllm:e2e_request_latency_seconds_count"
    assert after[e2e] - before[e2e] == 1
    assert f"Aborted request(s) {received[0]['id']}\n" in server.log()  # one line says so
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 3 <= generated < max_tokens  # aborted, not run to the end
    assert after.get(SUCCESS_LENGTH, 0) == before.get(SUCCESS_LENGTH, 0)
    # And the server serves the next client normally.
    assert _complete(server, "Hello", 2)["usage"]["completion_tokens"] >= 1


def test_disconnect_while_waiting_for_non_streaming_response(server):
    max_tokens = 400
    before = _wait_for(server, _released)
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}

    async def request_then_leave() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            request = asyncio.create_task(client.post(server.url_for("v1/completions"),
                                                      json=body))
            deadline = time.monotonic() + 60
            while True:  # until the engine is generating for it
                metrics = scrape_metrics(server)
                if _held(metrics) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            request.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await request
            return metrics

    aborted_before = server.log().count("Aborted request(s) cmpl-")
    during = asyncio.run(request_then_leave())
    assert _held(during), during
    after = _wait_for(server, lambda m: _released(m)
                      and m[SUCCESS_ABORT] > before[SUCCESS_ABORT])
    assert _released(after), after
    assert server.log().count("Aborted request(s) cmpl-") == aborted_before + 1
    assert after[SUCCESS_ABORT] - before[SUCCESS_ABORT] == 1
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < max_tokens
    assert after.get(SUCCESS_LENGTH, 0) == before.get(SUCCESS_LENGTH, 0)


# ------------------------------------------------------------------ vLLM's names, dashboard
DASHBOARD = Path(__file__).resolve().parents[3] / "examples" / "grafana" / "vllm_dashboard.json"
# Names vLLM's stock dashboard and users' alerts read (issue 16), beyond REQUIRED.
VLLM_NAMES = [
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
    "vllm:iteration_tokens_total_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:cache_config_info", "process_resident_memory_bytes", "process_cpu_seconds_total",
    "python_gc_collections_total", "python_info",
]
_NAME = re.compile(r"\b((?:vllm:|process_|python_)[A-Za-z0-9_:]+)")


def _sample_names(server) -> set[str]:
    return {key.split("{", 1)[0] for key in scrape_metrics(server)}


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    return queries


def test_vllm_metric_names_and_collectors_exist(server):
    names = _sample_names(server)
    missing = [name for name in VLLM_NAMES if name not in names]
    assert not missing, missing


def test_every_name_the_dashboard_queries_exists_on_a_live_server(server):
    queried = {name for query in _dashboard_queries() for name in _NAME.findall(query)}
    assert {"vllm:kv_cache_committed_bytes", "vllm:kv_cache_reserved_bytes"} <= queried
    missing = sorted(queried - _sample_names(server))
    assert not missing, f"the dashboard queries names /metrics does not have: {missing}"


def test_request_histograms_follow_a_request(server):
    """vLLM's meanings: token counts per finished request, one observation per phase,
    and steps that together computed the prompt and the generated tokens."""
    keys = ["vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
            "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
            "vllm:request_decode_time_seconds_count",
            "vllm:request_inference_time_seconds_count", "vllm:iteration_tokens_total_sum"]
    before = scrape_metrics(server)
    usage = _complete(server, LONG_PROMPT, 4, ignore_eos=True)["usage"]
    after = _wait_for(server, lambda m: m["vllm:request_decode_time_seconds_count"]
                      > before["vllm:request_decode_time_seconds_count"])
    delta = {k: after[k] - before[k] for k in keys}
    assert delta["vllm:request_prompt_tokens_sum"] == usage["prompt_tokens"]
    assert delta["vllm:request_generation_tokens_sum"] == usage["completion_tokens"] == 4
    assert all(delta[k] == 1 for k in keys if k.endswith("_count")), delta
    assert delta["vllm:iteration_tokens_total_sum"] == usage["prompt_tokens"] + 4
    phases = {p: after[f"vllm:request_{p}_time_seconds_sum"]
              - before[f"vllm:request_{p}_time_seconds_sum"]
              for p in ("queue", "prefill", "decode", "inference")}
    assert all(v >= 0 for v in phases.values())
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], abs=1e-6)
    info = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and "block_size=16" in info[0] and after[info[0]] == 1
