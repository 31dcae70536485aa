"""The disaggregation proxy over several instances, against fake instances on real sockets.

Each fake instance is a small FastAPI app served by uvicorn in a thread: a prefill answers
kv_transfer_params naming itself; a decode answers which instance served it and the
kv_transfer_params it got (or an SSE stream of three chunks and `data: [DONE]`). A body
with "hold": true makes the decode wait until the test sets its `release` event, so
requests stay in flight for as long as a test needs; nothing assumes a speed (every wait
polls with a deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.disagg_proxy import build_app, parse_args

DEADLINE_S = 10.0
BODY = {"model": "m", "prompt": "hello", "max_tokens": 5}


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class _Server:
    """An ASGI app served by uvicorn on 127.0.0.1 in a thread; stop() and start() again
    keep the port."""

    def __init__(self, app: FastAPI) -> None:
        self.app, self.port = app, 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        _wait_for(lambda: self._server.started, f"a server on port {self.port}")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(DEADLINE_S)
        self._sock.close()
        assert not self._thread.is_alive(), f"the server on port {self.port} did not stop"


class _Instance(_Server):
    """A fake vLLM prefill or decode instance; `received` holds the bodies it was sent."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.received: list[dict] = []
        self.release = threading.Event()
        super().__init__(self._app())

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.received.append(body)
            if self.role in body.get("fail_with", {}):  # {"decode": 503}: the decode fails
                return JSONResponse({"error": {"message": f"{self.role} engine dead"}},
                                    status_code=body["fail_with"][self.role])
            if self.role == "prefill":
                return {"choices": [{"text": "x"}],
                        "kv_transfer_params": {"do_remote_prefill": True,
                                               "remote_engine_id": self.url}}
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            if body.get("hold"):
                await self._held()
            return {"served_by": self.url, "kv_transfer_params": body["kv_transfer_params"]}

        return app

    async def _held(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not self.release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _stream(self, body: dict):
        for i in range(3):
            yield f"data: {json.dumps({'served_by': self.url, 'i': i})}\n\n"
            while body.get("hold") and not self.release.is_set():
                await asyncio.sleep(0.01)
                yield ": still here\n\n"  # lets the proxy notice a client that is gone
        yield "data: [DONE]\n\n"


def _dead_url() -> str:
    """A URL where nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def _proxy(prefill_urls: list[str], decode_urls: list[str], policy: str = "least_loaded"
           ) -> Iterator[str]:
    server = _Server(build_app(prefill_urls, decode_urls, policy=policy, probe_interval_s=0.05))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def instances():
    """make(role) starts a fake instance; all are released and stopped at the end."""
    made: list[_Instance] = []

    def make(role: str) -> _Instance:
        made.append(_Instance(role))
        return made[-1]

    yield make
    for instance in made:
        instance.release.set()
    for instance in made:
        if instance._thread.is_alive():
            instance.stop()


def _post(proxy: str, **extra) -> httpx.Response:
    return httpx.post(f"{proxy}/v1/completions", json=dict(BODY, **extra), timeout=DEADLINE_S)


def _served_by(proxy: str, **extra) -> str:
    r = _post(proxy, **extra)
    assert r.status_code == 200, r.text
    return r.json()["served_by"]


def _state(proxy: str) -> dict[str, tuple[bool, int]]:
    """url -> (healthy, in_flight), from GET /instances."""
    r = httpx.get(f"{proxy}/instances", timeout=DEADLINE_S)
    return {i["url"]: (i["healthy"], i["in_flight"]) for i in r.json()["instances"]}


def test_least_loaded_spreads_concurrent_requests(instances):
    p, a, b = instances("prefill"), instances("decode"), instances("decode")
    with _proxy([p.url], [a.url, b.url]) as proxy, ThreadPoolExecutor(4) as pool:
        held = [pool.submit(_served_by, proxy, hold=True) for _ in range(4)]
        _wait_for(lambda: len(a.received) + len(b.received) == 4, "4 requests at the decodes")
        assert _state(proxy) == {p.url: (True, 0), a.url: (True, 2), b.url: (True, 2)}
        r = httpx.get(f"{proxy}/instances", timeout=DEADLINE_S).json()
        assert r["policy"] == "least_loaded"
        assert {i["url"]: i["role"] for i in r["instances"]} == {
            p.url: "prefill", a.url: "decode", b.url: "decode"}
        a.release.set()
        b.release.set()
        assert sorted(f.result() for f in held) == sorted([a.url, a.url, b.url, b.url])
        assert _state(proxy) == {p.url: (True, 0), a.url: (True, 0), b.url: (True, 0)}


@pytest.mark.parametrize("policy, expected", [
    ("least_loaded", ["b", "b", "b"]),  # a is busy with the held request
    ("round_robin", ["b", "a", "b"]),
])
def test_policy_around_a_busy_decode(instances, policy, expected):
    p, a, b = instances("prefill"), instances("decode"), instances("decode")
    names = {a.url: "a", b.url: "b"}
    with _proxy([p.url], [a.url, b.url], policy) as proxy, ThreadPoolExecutor(1) as pool:
        assert [names[_served_by(proxy)] for _ in range(2)] == ["a", "b"]  # ties: in turn
        held = pool.submit(_served_by, proxy, hold=True)
        _wait_for(lambda: _state(proxy)[a.url] == (True, 1), "the held request on a")
        assert [names[_served_by(proxy)] for _ in range(3)] == expected
        a.release.set()
        assert held.result() == a.url


def test_dead_decode_leaves_rotation_and_rejoins(instances, caplog):
    caplog.set_level(logging.INFO, logger="vllm.entrypoints.disagg_proxy")
    p, a, b = instances("prefill"), instances("decode"), instances("decode")
    with _proxy([p.url], [a.url, b.url]) as proxy:
        assert _served_by(proxy) == a.url
        b.stop()
        assert _served_by(proxy) == a.url  # b's turn: refused, so retried on a
        assert _state(proxy)[b.url] == (False, 0)
        assert [_served_by(proxy) for _ in range(3)] == [a.url] * 3
        b.start()
        _wait_for(lambda: _state(proxy)[b.url] == (True, 0), "b back in rotation")
        assert {_served_by(proxy) for _ in range(2)} == {a.url, b.url}
    rotation = [r.getMessage() for r in caplog.records if "rotation" in r.getMessage()]
    assert len(rotation) == 2, rotation  # one line each way
    assert rotation[0].startswith(f"decode instance {b.url} left rotation: ")
    assert rotation[1] == f"decode instance {b.url} rejoined rotation (GET /health is 200)"


def test_all_decodes_down_is_503_without_a_prefill(instances):
    p, a, b = instances("prefill"), instances("decode"), instances("decode")
    with _proxy([p.url], [a.url, b.url]) as proxy:
        a.stop()
        b.stop()
        failed = _post(proxy)  # refused by one, retried on the other: refused again
        assert failed.status_code == 502
        error = failed.json()["error"]
        assert error["type"] == "BadGatewayError" and error["code"] == 502
        assert error["param"] is None
        assert f"the decode instance {b.url} failed" in error["message"]
        prefills_before = len(p.received)
        r = _post(proxy)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "no decode instance is available" in error["message"]
        assert a.url in error["message"] and b.url in error["message"]
        assert len(p.received) == prefills_before  # no prefill for a request nobody decodes


def test_prefill_connect_error_is_retried_on_the_other_prefill(instances):
    dead, p, d = _dead_url(), instances("prefill"), instances("decode")
    with _proxy([dead, p.url], [d.url]) as proxy:
        r = _post(proxy)  # the dead prefill's turn first
        assert r.status_code == 200, r.text
        assert r.json() == {"served_by": d.url, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_engine_id": p.url}}
        assert p.received == [dict(BODY, max_tokens=1, stream=False,
                                   kv_transfer_params={"do_remote_decode": True})]
        assert d.received == [dict(BODY, kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": p.url})]
        assert _state(proxy) == {dead: (False, 0), p.url: (True, 0), d.url: (True, 0)}


def test_decode_connect_error_is_retried_on_the_other_decode(instances):
    p, d = instances("prefill"), instances("decode")
    dead = _dead_url()
    with _proxy([p.url], [dead, d.url], policy="round_robin") as proxy:
        r = _post(proxy)  # the dead decode's turn first: nothing reached it
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == d.url
        assert _state(proxy) == {p.url: (True, 0), dead: (False, 0), d.url: (True, 0)}


def test_lone_dead_prefill_is_502_then_503(instances):
    dead, d = _dead_url(), instances("decode")
    with _proxy([dead], [d.url]) as proxy:
        first, second = _post(proxy), _post(proxy)
        assert first.status_code == 502
        assert f"the prefill instance {dead} failed" in first.json()["error"]["message"]
        assert second.status_code == 503
        assert f"no prefill instance is available: all of {dead}" in (
            second.json()["error"]["message"])
        assert d.received == []
        assert _state(proxy)[d.url] == (True, 0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_instance_error_passes_through_and_stays_in_rotation(instances, role):
    p, d = instances("prefill"), instances("decode")
    with _proxy([p.url], [d.url]) as proxy:
        r = _post(proxy, fail_with={role: 503})
        assert r.status_code == 503
        assert r.json() == {"error": {"message": f"{role} engine dead"}}
        assert len(d.received) == (role == "decode")  # a failed prefill sends no decode
        assert _state(proxy) == {p.url: (True, 0), d.url: (True, 0)}


def test_stream_is_relayed_and_in_flight_returns_to_zero(instances):
    p, d = instances("prefill"), instances("decode")
    with _proxy([p.url], [d.url]) as proxy:
        r = _post(proxy, stream=True)
        assert r.status_code == 200
        events = [line for line in r.text.split("\n\n") if line]
        assert events == [f"data: {json.dumps({'served_by': d.url, 'i': i})}"
                          for i in range(3)] + ["data: [DONE]"]
        assert d.received[0]["stream"] is True
        _wait_for(lambda: _state(proxy)[d.url] == (True, 0), "the stream's count to end")


def test_client_gone_mid_stream_ends_the_in_flight_count(instances):
    p, d = instances("prefill"), instances("decode")
    with _proxy([p.url], [d.url]) as proxy, httpx.Client(timeout=DEADLINE_S) as client:
        with client.stream("POST", f"{proxy}/v1/completions",
                           json=dict(BODY, stream=True, hold=True)) as r:
            chunks = r.iter_raw()  # kept: a dropped iterator closes the connection
            assert next(chunks).startswith(b"data: ")
            assert _state(proxy)[d.url] == (True, 1)
        # the client closed the connection mid-stream; the decode is still holding
        _wait_for(lambda: _state(proxy)[d.url] == (True, 0), "the count to end on disconnect")
        assert not d.release.is_set()


def test_cli_and_build_app_arguments():
    args = parse_args(["--prefill", "http://p", "--decode", "http://d1", "http://d2"])
    assert (args.prefill, args.decode, args.policy) == (["http://p"], ["http://d1", "http://d2"],
                                                        "least_loaded")
    assert parse_args(["--prefill", "p", "--decode", "d", "--policy", "round_robin"]).policy == (
        "round_robin")
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        build_app(["http://p"], ["http://d"], policy="fastest")
    with pytest.raises(ValueError, match="no decode instance URL given"):
        build_app(["http://p"], [])


def test_health_reflects_the_backends(instances):
    """The proxy's /health probes its instances: 503 naming those down while a role has
    none answering (it was 200 with every backend down), 200 once one of each is back."""
    prefill, decode = instances("prefill"), instances("decode")
    with _proxy([prefill.url], [decode.url, _dead_url()]) as proxy:
        assert httpx.get(f"{proxy}/health", timeout=DEADLINE_S).status_code == 200
        decode.stop()
        r = httpx.get(f"{proxy}/health", timeout=DEADLINE_S)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == 503 and decode.url in error["message"], error
        assert prefill.url not in error["message"]
        decode.start()
        assert httpx.get(f"{proxy}/health", timeout=DEADLINE_S).status_code == 200
        assert _served_by(proxy) == decode.url  # the probe put it back into rotation


def test_the_proxy_logs_like_vllm_serve(instances):
    """A start-up line with the URL it listens on, one access-log line per request, exit
    0 on SIGTERM; a port that cannot be bound is one line and exit 2."""
    import re
    import signal
    import subprocess
    import sys

    from tests.entrypoints.openai.utils import REPO_ROOT

    prefill, decode = instances("prefill"), instances("decode")
    command = [sys.executable, "-m", "vllm.entrypoints.disagg_proxy", "--prefill", prefill.url,
               "--decode", decode.url]
    proc = subprocess.Popen([*command, "--port", "0"], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = []
        while (line := proc.stdout.readline()) and "listening on" not in line:
            lines.append(line)
        url = re.search(r"listening on (http://\S+)", line).group(1)
        assert any(f"prefill ['{prefill.url}'], decode ['{decode.url}']" in x for x in lines)
        assert httpx.get(f"{url}/health", timeout=DEADLINE_S).status_code == 200
        later = []
        while (line := proc.stdout.readline()) and "GET /health" not in line:
            later.append(line)  # uvicorn's "Application startup complete."
        assert '"GET /health HTTP/1.1" 200' in line, later
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            result = subprocess.run([*command, "--port", str(port)], cwd=REPO_ROOT, text=True,
                                    capture_output=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr == (f"disagg_proxy: error: cannot listen on 127.0.0.1:{port}: "
                                 "Address already in use\n")
    finally:
        proc.kill()
        proc.wait(DEADLINE_S)
