"""`vllm serve --enable-elastic-kv-cache` (issue #18): the runtime limit endpoint, the
elastic counters and committed bytes on /metrics, one log line per change.

The bundled model: 30 layer segments of 24 KiB blocks, 85 blocks (59.77 MiB of blocks,
60 MiB of device memory) per 2 MiB granule a segment. The server's floor is one
max_model_len (512-token) request: 85 blocks; 256 MiB of KV allow 4 granules (8 MiB) a
segment: 341 blocks. Free tail blocks are released after 10 s (the default
`VLLM_ELASTIC_KV_SHRINK_DELAY_S`), so the release after a burst happens while the server
is idle: /metrics must follow it then too.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.utils import (
    DEFAULT_SERVER_ARGS,
    MODEL_NAME,
    RemoteServer,
    error_of,
    scrape_metrics,
)

pytestmark = pytest.mark.slow

MiB = 1 << 20
BLOCK_BYTES = 30 * (24 << 10)  # a block: 24 KiB in each of the 30 layer segments
FLOOR_BYTES = 85 * BLOCK_BYTES  # committed bytes: blocks x bytes per block
FLOOR_PHYSICAL = 60 * MiB  # what the device holds: one 2 MiB granule a segment
# 16 requests of ~200 prompt tokens: ~14 blocks each, far more than the floor's 84.
BURST = [f"Tell me story number {i} about a lighthouse keeper and the sea. " * 14
         for i in range(16)]


@pytest.fixture(scope="module")
def registry_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kv-registry"))


@pytest.fixture(scope="module")
def elastic_server(registry_dir):
    with RemoteServer([*DEFAULT_SERVER_ARGS, "--enable-elastic-kv-cache",
                       "--served-model-name", "engine-a", MODEL_NAME],
                      env={"VLLM_ELASTIC_KV_SHRINK_DELAY_S": "2",
                           "VLLM_KV_REGISTRY_DIR": registry_dir}) as remote:
        yield remote


def _burst(server: RemoteServer) -> list[str]:
    def complete(prompt: str) -> str:
        response = httpx.post(server.url_for("v1/completions"), timeout=300, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(BURST)) as pool:
        return list(pool.map(complete, BURST))


def _committed(server: RemoteServer) -> float:
    return scrape_metrics(server)["vllm:kv_cache_committed_bytes"]


def _wait_for_committed(server: RemoteServer, nbytes: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _committed(server) != nbytes:
        assert time.monotonic() < deadline, f"committed {_committed(server)}, not {nbytes}"
        time.sleep(0.2)


def _set_limit(server: RemoteServer, value: str | None) -> httpx.Response:
    params = {} if value is None else {"limit_bytes": value}
    return httpx.post(server.url_for("kv_cache/limit"), params=params, timeout=60)


def test_the_limit_endpoint_exists_only_with_the_elastic_flag(server):
    response = _set_limit(server, "1GiB")
    assert response.status_code == 404
    error_of(response)


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bad_limit_is_a_400_naming_limit_bytes(elastic_server, value):
    response = _set_limit(elastic_server, value)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "limit_bytes"


def test_a_limit_in_the_body_is_refused_not_ignored(elastic_server):
    response = httpx.post(elastic_server.url_for("kv_cache/limit"), timeout=60,
                          json={"limit_bytes": 100_000_000})
    assert response.status_code == 400, response.text
    assert "in the query string" in error_of(response)["message"]


@pytest.mark.parametrize("query", [{"limit": "90MiB"}, {"limit_byte": "90MiB"},
                                   [("limit_bytes", "90MiB"), ("limit_bytes", "1GiB")]],
                         ids=["unknown", "misspelt", "repeated"])
def test_a_query_other_than_one_limit_bytes_is_refused_not_ignored(elastic_server, query):
    """A misspelt name (`?limit=90MiB`) was ignored: the call restored the start-up limit
    and answered 200, the opposite of what the operator asked."""
    response = httpx.post(elastic_server.url_for("kv_cache/limit"), params=query, timeout=60)
    assert response.status_code == 400, response.text
    name = "limit_bytes" if isinstance(query, list) else next(iter(query))
    assert error_of(response)["param"] == name and name in error_of(response)["message"]


def test_committed_bytes_follow_a_burst_up_and_back_down(elastic_server):
    _wait_for_committed(elastic_server, FLOOR_BYTES)
    before = scrape_metrics(elastic_server)
    texts = _burst(elastic_server)
    assert all(texts)
    grown = scrape_metrics(elastic_server)
    assert grown["vllm:kv_cache_elastic_grows_total"] > before["vllm:kv_cache_elastic_grows_total"]
    # Idle again: the free tail goes back, down to the floor, and /metrics says so
    # although no request runs (the engine process's figures are read while idle).
    _wait_for_committed(elastic_server, FLOOR_BYTES)
    after = scrape_metrics(elastic_server)
    assert after["vllm:kv_cache_elastic_shrinks_total"] > before[
        "vllm:kv_cache_elastic_shrinks_total"]
    assert after["vllm:kv_cache_reserved_bytes"] > 4 * FLOOR_BYTES
    log = elastic_server.log()
    assert "Elastic KV cache: grew 0.06 -> " in log
    assert " -> 0.06 GiB (" in log and "Elastic KV cache: released " in log


def test_a_runtime_limit_holds_the_cache_and_a_bare_post_restores_it(elastic_server):
    _wait_for_committed(elastic_server, FLOOR_BYTES)
    # The limit in blocks' bytes, the unit /metrics and kv-top report: 85 blocks, the floor.
    response = _set_limit(elastic_server, str(FLOOR_BYTES + BLOCK_BYTES - 1))
    assert response.status_code == 200, response.text
    assert response.json() == {"limit_blocks": 85, "limit_bytes": FLOOR_BYTES,
                               "committed_bytes": FLOOR_BYTES, "num_blocks": 85}
    grows = scrape_metrics(elastic_server)["vllm:kv_cache_elastic_grows_total"]
    assert all(_burst(elastic_server))  # served within the floor (queued, not refused)
    metrics = scrape_metrics(elastic_server)
    assert metrics["vllm:kv_cache_elastic_grows_total"] == grows
    assert metrics["vllm:kv_cache_committed_bytes"] == FLOOR_BYTES
    response = _set_limit(elastic_server, None)
    assert response.status_code == 200, response.text
    assert response.json()["limit_blocks"] == 341  # 8 MiB / 24 KiB
    # A figure read back from the reply (or /metrics, kv-top) is the same limit: granule-
    # rounded bytes made the bundled model's 341 blocks 256.
    limit_bytes = response.json()["limit_bytes"]
    assert limit_bytes == 341 * BLOCK_BYTES
    assert _set_limit(elastic_server, str(limit_bytes)).json()["limit_blocks"] == 341
    assert "Elastic KV cache: limit set to 0.06 GiB (85 blocks)" in elastic_server.log()


def test_kv_top_and_metrics_show_one_committed_figure_and_the_served_name(
        elastic_server, registry_dir):
    """At the floor /metrics said committed 62914560 (whole granules) while its limit and
    `vllm kv-top` said 62668800 (blocks x bytes): committed above the limit. One unit now,
    blocks' bytes, with the device's granules as physical_bytes; and kv-top names the
    engine by --served-model-name (it showed the model file's name)."""
    from vllm.entrypoints.cli.kv_top import snapshot

    _wait_for_committed(elastic_server, FLOOR_BYTES)
    assert _set_limit(elastic_server, str(FLOOR_BYTES)).status_code == 200  # at the floor
    try:
        metrics = scrape_metrics(elastic_server)
        assert metrics["vllm:kv_cache_committed_bytes"] == FLOOR_BYTES
        assert metrics["vllm:kv_cache_limit_bytes"] == FLOOR_BYTES
        assert metrics["vllm:kv_cache_physical_bytes"] == FLOOR_PHYSICAL
        deadline = time.monotonic() + 30
        while True:  # the registry is refreshed at most every PUBLISH_S
            (engine,) = [e for engines in snapshot(registry_dir).values() for e in engines]
            if engine["limit"] == FLOOR_BYTES or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert engine["name"] == "engine-a"
        assert (engine["committed"], engine["limit"]) == (FLOOR_BYTES, FLOOR_BYTES)
        models = httpx.get(elastic_server.url_for("v1/models"), timeout=30).json()
        assert models["data"][0]["id"] == "engine-a"
    finally:
        assert _set_limit(elastic_server, None).status_code == 200
