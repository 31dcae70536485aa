"""1P1D and 1P2D over real NIXL (UCX, DRAM on the CPU): `vllm serve` instances and the proxy.

The prefill instance (kv_producer) computes each prompt's KV; a decode
instance (kv_consumer) reads the blocks over NIXL in the background and
generates. Greedy outputs must equal one engine's, a decode instance must
compute only the last prompt token of each transferred prompt, a load held
back (the prefill instance stopped with SIGSTOP: its UCX cannot answer) must
not hold back the decode instance's other requests, and a prefill instance
killed mid-load must fail that request alone, with its blocks freed.
"""

from __future__ import annotations

import json
import os
import signal
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
    if role == "kv_consumer":  # a held-back load (SIGSTOP below) must outlive the default 2 s
        config["kv_connector_extra_config"] = {"liveness_timeout_s": 10}
    return [*DEFAULT_SERVER_ARGS, "--kv-transfer-config", json.dumps(config),
            "--enable-sleep-mode"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def disagg_servers():
    """{"kv_producer", "kv_consumer", "kv_consumer2"} -> server, started in parallel, and
    the proxy's URL over the prefill and both decode instances (1P2D)."""
    servers: dict[str, RemoteServer] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            servers[name] = RemoteServer(_kv_args(name.rstrip("2")))
        except BaseException as e:  # re-raised below, after every thread ends
            errors.append(e)

    names = ("kv_producer", "kv_consumer", "kv_consumer2")
    threads = [threading.Thread(target=start, args=(n,)) for n in names]
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
             "--prefill", servers["kv_producer"].url,
             "--decode", servers["kv_consumer"].url, servers["kv_consumer2"].url],
            cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), **_env()})
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proxy)
        yield servers, url
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait(30)
        closing: list[BaseException] = []
        for server in servers.values():  # every one, also after another hung
            try:
                server.close()
            except BaseException as e:
                closing.append(e)
        if closing:
            raise closing[0]


@pytest.fixture(scope="module")
def disagg(disagg_servers):
    """(prefill server, a decode server, proxy URL over both decode servers)."""
    servers, url = disagg_servers
    return servers["kv_producer"], servers["kv_consumer"], url


def _decodes(disagg_servers) -> list[RemoteServer]:
    servers, _ = disagg_servers
    return [servers["kv_consumer"], servers["kv_consumer2"]]


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


def test_1p2d_outputs_equal_one_instance(disagg, disagg_servers, reference):
    prefill, decode, proxy = disagg
    decodes = _decodes(disagg_servers)
    before = [_by_source(d) for d in decodes]
    texts = []
    for prompt in PROMPTS:
        r = _complete(proxy, prompt)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts == reference
    after = [_by_source(d) for d in decodes]
    moved = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in after[0]}
    # Each prompt's KV but that of its last token came over NIXL: one token computed each.
    assert moved["local_compute"] == len(PROMPTS)
    num_prompt_tokens = sum(len(decode_tokens(decode, p)) for p in PROMPTS)
    assert moved["external_kv_transfer"] == num_prompt_tokens - len(PROMPTS)
    # The proxy spread the requests over both decode instances.
    assert all(a["external_kv_transfer"] > b["external_kv_transfer"]
               for a, b in zip(after, before, strict=True))
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
                    chunk = json.loads(line[6:])
                    assert "choices" in chunk, chunk
                    text += chunk["choices"][0]["text"]
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


def test_replayed_params_are_refused_and_leave_no_wrong_kv(disagg_servers, reference):
    """kv_transfer_params read once are refused the second time (even by another decode
    instance), so blocks the prefill instance may have reused are never read."""
    servers, _ = disagg_servers
    prefill, first, second = (servers[k] for k in ("kv_producer", "kv_consumer",
                                                   "kv_consumer2"))
    params = _prefill_params(prefill, PROMPTS[5])
    r = _complete(first.url, PROMPTS[5], kv_transfer_params=params)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[5]
    replay = _complete(second.url, PROMPTS[5], kv_transfer_params=params)
    assert replay.status_code == 502, replay.text
    assert "another reader took them" in error_of(replay)["message"]
    plain = _complete(second.url, PROMPTS[5])  # nothing wrong entered its prefix cache
    assert plain.json()["choices"][0]["text"] == reference[5]


def test_params_that_do_not_fit_the_request_are_400(disagg):
    prefill, decode, proxy = disagg
    params = _prefill_params(prefill, PROMPTS[6])
    longer = " ".join([PROMPTS[6]] * 8)  # needs more blocks than the params hold
    for url, prompt, extra, message in [
        (decode.url, longer, {"kv_transfer_params": params}, "remote_block_ids holds"),
        (decode.url, PROMPTS[6], {"kv_transfer_params": params, "n": 2}, "needs n=1"),
        (proxy, [PROMPTS[6], PROMPTS[7]], {}, "needs one prompt"),
        (proxy, PROMPTS[6], {"n": 2}, "needs n=1"),
    ]:
        r = _complete(url, prompt, **extra)
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] == "kv_transfer_params"
        assert message in error_of(r)["message"]


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
    held = scrape_metrics(prefill)
    assert held["vllm:kv_cache_usage_perc"] > 0.0  # held for the reader
    assert held["vllm:kv_transfer_held_blocks"] > 0.0
    _sleep_and_wake(prefill)
    assert scrape_metrics(prefill)["vllm:kv_cache_usage_perc"] == 0.0
    assert "Sleep: freed the blocks of 1 finished request(s)" in prefill.log()
    r = _complete(decode.url, prompt, kv_transfer_params=params)
    assert r.status_code == 502, r.text
    assert "no longer holds the blocks" in error_of(r)["message"]
    _wait_for(lambda: scrape_metrics(decode)["vllm:kv_cache_usage_perc"] == 0.0)


def _signal_instance(server: RemoteServer, sig: int) -> list[psutil.Process]:
    """Send `sig` to the server and every process under it (engine core, worker)."""
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]
    for proc in procs:
        os.kill(proc.pid, sig)
    return procs


def _prefill_params(prefill: RemoteServer, prompt: str) -> dict:
    r = _complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args, **kwargs)))
    thread.start()
    return thread, result


def _stream_tokens(url: str, prompt: str, max_tokens: int, on_token) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                on_token(json.loads(line[6:]))


def test_a_held_back_load_does_not_hold_back_other_requests(disagg, reference):
    """The prefill instance is stopped (SIGSTOP): the decode instance's READ cannot finish.
    Meanwhile another request on the decode instance streams tokens; once the prefill
    instance runs again the held request completes with the right text."""
    prefill, decode, _ = disagg
    params = _prefill_params(prefill, PROMPTS[3])
    _signal_instance(prefill, signal.SIGSTOP)
    try:
        held, held_result = _in_thread(_complete, decode.url, PROMPTS[3],
                                       kv_transfer_params=params)
        _wait_for(lambda: scrape_metrics(decode)[
            "vllm:num_requests_waiting_for_remote_kvs"] == 1.0)
        tokens_while_held: list[int] = []

        def on_token(chunk: dict) -> None:
            if held.is_alive():
                tokens_while_held.append(1)

        _stream_tokens(decode.url, "Count: one two", 12, on_token)
        assert held.is_alive() and len(tokens_while_held) == 12
    finally:
        _signal_instance(prefill, signal.SIGCONT)
    held.join(60)
    assert held_result[0].status_code == 200, held_result[0].text
    assert held_result[0].json()["choices"][0]["text"] == reference[3]


def test_dead_prefill_instance(disagg):
    """Last in the module: it kills the shared prefill instance, mid-load."""
    prefill, decode, proxy = disagg
    prompt = PROMPTS[0] + " and more"
    params = _prefill_params(prefill, prompt)
    # The load starts while the prefill instance is stopped, then the whole instance
    # dies (server, engine core, worker), as in a crash.
    procs = _signal_instance(prefill, signal.SIGSTOP)
    thread, result = _in_thread(_complete, decode.url, prompt, kv_transfer_params=params)
    _wait_for(lambda: scrape_metrics(decode)["vllm:num_requests_waiting_for_remote_kvs"] == 1.0)
    for proc in procs:
        proc.kill()
    psutil.wait_procs(procs, timeout=30)
    thread.join(60)
    r = result[0]
    assert r.status_code == 502, r.text
    message = error_of(r)["message"]
    assert "could not read its KV from the prefill instance" in message
    metrics = scrape_metrics(decode)
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0  # its blocks were freed
    assert metrics["vllm:num_requests_running"] == 0.0
    assert metrics["vllm:num_requests_waiting_for_remote_kvs"] == 0.0
    ok = _complete(decode.url, "Hello")  # and it still serves
    assert ok.status_code == 200

    r = _complete(proxy, PROMPTS[1])
    assert r.status_code == 502
    assert "the prefill instance http://127.0.0.1" in error_of(r)["message"]
