"""1P1D over real NIXL (UCX, DRAM on the CPU): two `vllm serve` instances and the proxy.

The prefill instance (kv_producer) computes each prompt's KV; the decode
instance (kv_consumer) reads the blocks over NIXL and generates. Greedy
outputs must equal one engine's, the decode instance must compute only the
last prompt token of each transferred prompt, and a dead prefill instance must
give the client a clear error while the decode instance frees what it held.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.entrypoints.openai.utils import (
    DEFAULT_SERVER_ARGS,
    MODEL_NAME,
    REPO_ROOT,
    RemoteServer,
    error_of,
    scrape_metrics,
)
from vllm import SamplingParams

pytest.importorskip("nixl_cu13", reason="NixlConnector tests need nixl-cu13 (test deps)")

PROMPTS = [f"Fact {i}: the {w} is" for i, w in enumerate(
    ["sky", "sea", "sun", "moon", "grass", "snow", "fire", "night", "rose", "gold", "coal",
     "milk", "blood", "lemon", "ink", "ash"])]
MAX_TOKENS = 6


def _kv_args(role: str) -> list[str]:
    config = {"kv_connector": "NixlConnector", "kv_role": role}
    return [*DEFAULT_SERVER_ARGS, "--kv-transfer-config", json.dumps(config),
            "--enable-sleep-mode"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def disagg():
    """(prefill server, decode server, proxy URL); the two servers start in parallel."""
    servers: dict[str, RemoteServer] = {}
    errors: list[BaseException] = []

    def start(role: str) -> None:
        try:
            servers[role] = RemoteServer(_kv_args(role))
        except BaseException as e:  # re-raised below, after both threads end
            errors.append(e)

    threads = [threading.Thread(target=start, args=(r,)) for r in ("kv_producer", "kv_consumer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proxy = None
    try:
        if errors:
            raise errors[0]
        port = _free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.disagg_proxy", "--port", str(port),
             "--prefill", servers["kv_producer"].url, "--decode", servers["kv_consumer"].url],
            cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), **_env()})
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proxy)
        yield servers["kv_producer"], servers["kv_consumer"], url
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait(30)
        for server in servers.values():
            server.close()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the proxy never became healthy")


@pytest.fixture(scope="module")
def reference(offline_llm) -> list[str]:
    outputs = offline_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outputs]


def _by_source(server: RemoteServer) -> dict[str, float]:
    metrics = scrape_metrics(server)
    return {s: metrics.get(f"vllm:prompt_tokens_by_source_total{{source={s}}}", 0.0)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def _complete(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_1p1d_outputs_equal_one_instance(disagg, reference):
    prefill, decode, proxy = disagg
    before = _by_source(decode)
    texts = []
    for prompt in PROMPTS:
        r = _complete(proxy, prompt)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts == reference
    after = _by_source(decode)
    # Each prompt's KV but that of its last token came over NIXL: one token computed each.
    assert after["local_compute"] - before["local_compute"] == len(PROMPTS)
    num_prompt_tokens = sum(len(decode_tokens(decode, p)) for p in PROMPTS)
    assert (after["external_kv_transfer"] - before["external_kv_transfer"]
            == num_prompt_tokens - len(PROMPTS))
    # The prefill instance freed every block once the decode instance had read it.
    _wait_for(lambda: scrape_metrics(prefill)["vllm:kv_cache_usage_perc"] == 0.0)


def decode_tokens(server: RemoteServer, prompt: str) -> list[int]:
    r = httpx.post(server.url_for("tokenize"), json={"model": MODEL_NAME, "prompt": prompt},
                   timeout=30)
    return r.json()["tokens"]


def test_1p1d_streaming_equals_one_instance(disagg, reference):
    _, _, proxy = disagg
    texts = []
    for prompt in PROMPTS:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", f"{proxy}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        texts.append(text)
    assert texts == reference


def test_1p1d_chat(disagg):
    """Chat through the proxy equals the decode instance computing it alone."""
    _, decode, proxy = disagg
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a color."}],
            "max_completion_tokens": MAX_TOKENS, "temperature": 0}
    via_proxy = httpx.post(f"{proxy}/v1/chat/completions", json=body, timeout=120)
    local = httpx.post(decode.url_for("v1/chat/completions"), json=body, timeout=120)
    assert via_proxy.status_code == local.status_code == 200, via_proxy.text
    content = [r.json()["choices"][0]["message"]["content"] for r in (via_proxy, local)]
    assert content[0] == content[1] and content[0]


def test_bad_kv_transfer_params_is_400(disagg):
    _, decode, _ = disagg
    r = _complete(decode.url, "Hi", kv_transfer_params={"do_remote_prefill": True})
    assert r.status_code == 400
    error = error_of(r)
    assert error["param"] == "kv_transfer_params"
    assert "remote_block_ids must be a list" in error["message"]


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def _sleep_and_wake(server: RemoteServer) -> None:
    assert httpx.post(server.url_for("sleep"), params={"level": 1}, timeout=60).status_code == 200
    assert httpx.post(server.url_for("wake_up"), timeout=60).status_code == 200


def test_1p1d_after_both_instances_slept_equals_one_instance(disagg, reference):
    """Both instances register their KV memory again after waking; the decode instance
    sees the prefill instance's new registration epoch and handshakes again."""
    prefill, decode, proxy = disagg
    for server in (prefill, decode):
        _sleep_and_wake(server)
    texts = []
    for prompt in PROMPTS[:4]:
        r = _complete(proxy, prompt)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts == reference[:4]
    assert "region(s) registered again after wake (epoch 1)" in prefill.log()
    assert "registered its KV memory again (epoch 0 -> 1); handshaking again" in decode.log()


def test_blocks_held_across_a_sleep_are_freed_and_their_read_fails_clearly(disagg):
    """Sleep discards the KV contents: a prefill instance frees the blocks it held for a
    reader, and the decode request for them fails with the reason (as for a dead
    instance) and frees what it allocated."""
    prefill, decode, _ = disagg
    prompt = PROMPTS[2] + " or so"
    r = _complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = r.json()["kv_transfer_params"]
    assert scrape_metrics(prefill)["vllm:kv_cache_usage_perc"] > 0.0  # held for the reader
    _sleep_and_wake(prefill)
    assert scrape_metrics(prefill)["vllm:kv_cache_usage_perc"] == 0.0
    assert "Sleep: freed the blocks of 1 finished request(s)" in prefill.log()
    r = _complete(decode.url, prompt, kv_transfer_params=params)
    assert r.status_code == 502, r.text
    assert "no longer holds the blocks" in error_of(r)["message"]
    _wait_for(lambda: scrape_metrics(decode)["vllm:kv_cache_usage_perc"] == 0.0)


def test_dead_prefill_instance(disagg):
    """Last in the module: it kills the shared prefill instance."""
    prefill, decode, proxy = disagg
    r = _complete(prefill.url, PROMPTS[0] + " and more", max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    # The whole instance dies (server, engine core, worker), as in a crash; the blocks
    # the decode instance would read are gone with it.
    children = psutil.Process(prefill.proc.pid).children(recursive=True)
    prefill.kill()
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=30)

    r = _complete(decode.url, PROMPTS[0] + " and more", kv_transfer_params=params)
    assert r.status_code == 502, r.text
    message = error_of(r)["message"]
    assert "could not read its KV from the prefill instance" in message
    metrics = scrape_metrics(decode)
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0  # its blocks were freed
    assert metrics["vllm:num_requests_running"] == 0.0
    ok = _complete(decode.url, "Hello")  # and it still serves
    assert ok.status_code == 200

    r = _complete(proxy, PROMPTS[1])
    assert r.status_code == 502
    assert "the prefill instance http://127.0.0.1" in error_of(r)["message"]
