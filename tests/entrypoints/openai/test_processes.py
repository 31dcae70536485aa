"""`vllm serve` as processes: frontend, engine core, workers (real processes, CPU, gloo).

- tensor_parallel_size=2 (mp and ray) answers greedy requests with the one-rank engine's text;
- a 10 MB prompt posted by another client does not stall a running stream;
- a killed worker is reported within seconds (/health 503 with the reason), the server
  exits 1, and no process of the tree is left (no zombie); likewise after Ctrl-C;
- a killed engine core process fails the requests in flight with a clear error (the
  OpenAI error body, or an SSE error event and [DONE]) instead of leaving them hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.conftest import TP_PROMPTS
from tests.entrypoints.openai.utils import DEFAULT_SERVER_ARGS, MODEL_NAME, RemoteServer, error_of

pytestmark = pytest.mark.slow


def tree(server: RemoteServer) -> list[psutil.Process]:
    """Every process the server started, its children's children included."""
    return psutil.Process(server.proc.pid).children(recursive=True)


def engine_and_workers(server: RemoteServer) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine core process (the child that has children) and its worker processes,
    in rank order (the executor logs their pids by rank; psutil lists them by pid)."""
    started = re.search(r"Started \d+ worker processes \(\w+; pids ([\d, ]+)\)", server.log())
    assert started, "the executor did not log its workers' pids"
    by_rank = [int(pid) for pid in started.group(1).split(",")]
    for child in psutil.Process(server.proc.pid).children():
        workers = {p.pid: p for p in child.children()}
        if set(by_rank) <= set(workers):
            return child, [workers[pid] for pid in by_rank]
    raise AssertionError(f"no engine core process with workers {by_rank} among {tree(server)}")


def wait_gone(processes: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"left behind: {[(p.pid, p.status()) for p in alive]}"


def greedy_texts(server: RemoteServer) -> dict[str, str]:
    texts = {}
    for prompt in TP_PROMPTS:
        response = httpx.post(server.url_for("v1/completions"), timeout=120, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        texts[prompt] = response.json()["choices"][0]["text"]
    return texts


# ------------------------------------------------------------------ TP=2, mp
@pytest.fixture(scope="module")
def tp2_server():
    with RemoteServer([*DEFAULT_SERVER_ARGS, "--tensor-parallel-size", "2"]) as remote:
        yield remote


def test_tp2_mp_server_matches_one_rank(tp2_server, tp_reference):
    engine, workers = engine_and_workers(tp2_server)
    assert len(workers) == 2
    assert greedy_texts(tp2_server) == {p: text for p, (_, text) in tp_reference.items()}
    log = tp2_server.log()
    assert "KV cache blocks agreed across 2 ranks" in log
    assert "Started 2 worker processes" in log  # the default backend on one node: mp
    assert "(worker rank 1 pid" in log  # each worker's lines say whose they are


def _stream_in_background(server: RemoteServer, events: list[str]
                          ) -> tuple[threading.Thread, threading.Event]:
    """A long greedy stream on a thread; the event is set once 3 SSE lines arrived."""
    streaming = threading.Event()
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", server.url_for("v1/completions"), json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    if len(events) == 3:
                        streaming.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    return thread, streaming


def test_killed_worker_is_reported_within_seconds(tp2_server):
    """A worker dies mid-stream: the stream ends with an SSE error event and [DONE],
    /health says which rank died and how, the whole tree goes, and the log has one
    line for it, no traceback."""
    engine, workers = engine_and_workers(tp2_server)
    everything = tree(tp2_server)
    events: list[str] = []
    assert _stream_in_background(tp2_server, events)[1].wait(120)
    killed_at = time.monotonic()
    workers[1].send_signal(signal.SIGKILL)
    health = None
    while time.monotonic() - killed_at < 10:
        try:
            health = httpx.get(tp2_server.url_for("health"), timeout=5)
        except httpx.ConnectError:
            break  # already exited: the log below must still say why
        if health.status_code == 503:
            break
        time.sleep(0.1)
    assert health is not None and health.status_code == 503, health
    message = error_of(health)["message"]
    assert "worker rank 1 died (killed by SIGKILL)" in message, message
    assert tp2_server.proc.wait(30) == 1
    wait_gone(everything)
    assert events[-1] == "data: [DONE]", events[-3:]
    assert "worker rank 1 died" in json.loads(events[-2].removeprefix("data: "))["error"][
        "message"]
    log = tp2_server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 300:]


# ------------------------------------------------------------------ TP=2, ray
def ctrl_c(server: RemoteServer) -> None:
    """What Ctrl-C in a terminal does: SIGINT to every process of the server's process
    group (the server shares pytest's group, so pytest is left out; Ray's daemons
    run in sessions of their own)."""
    group = os.getpgid(server.proc.pid)
    for process in [psutil.Process(server.proc.pid), *tree(server)]:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == group:
                process.send_signal(signal.SIGINT)


def test_tp2_ray_server_matches_one_rank_and_stops_on_ctrl_c(tp_reference):
    pytest.importorskip("ray")
    # A local Ray instance started by the engine, on loopback only.
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    args = [*DEFAULT_SERVER_ARGS, "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "ray"]
    with RemoteServer(args, env=env) as server:
        assert greedy_texts(server) == {p: text for p, (_, text) in tp_reference.items()}
        assert "Started 2 Ray workers" in server.log()
        everything = tree(server)  # engine core, Ray's processes, the worker actors
        ctrl_c(server)
        assert server.proc.wait(60) == 0
    wait_gone(everything)


# ------------------------------------------------------------------ one rank
POST_BIG_PROMPT = """
import httpx, json, sys
prompt = "All work and no play makes Jack a dull boy. " * (10_000_000 // 44)
body = json.dumps({"model": sys.argv[2], "prompt": prompt, "max_tokens": 4}).encode()
client = httpx.Client(timeout=300, headers={"Content-Type": "application/json"})
print("ready", flush=True)
sys.stdin.readline()
response = client.post(sys.argv[1], content=body)
print(response.status_code, json.dumps(response.json()["error"]["message"][:200]), flush=True)
"""


# What the CPU schedule and the body's own parse may add to one gap (see below).
BIG_PROMPT_SLACK_S = 0.25


def test_big_prompt_does_not_stall_a_running_stream(server):
    """Inter-token gaps while another client posts a 10 MB prompt stay within 2x the median
    plus `BIG_PROMPT_SLACK_S`.

    Receiving and parsing the body holds the event loop ~35 ms on this 2-core host
    (Starlette joins the chunks, json.loads decodes 10 MB), and four busy processes
    share the two cores (engine core, server, this test, the poster), so a gap of
    2x the median alone failed on HEAD in 4 of 4 runs (107-162 ms against a 45 ms
    median, 2026-12-03). A stall this test exists to catch is tokenizing or
    validating the 10 MB on the loop: seconds.

    On the session's one-rank server (conftest.py): its engine core runs in a
    process of its own like every server's. The other client is a process of its
    own that imports, builds and encodes its body before the stream starts, so
    the window measured holds only the server's handling of the 10 MB request
    (on 2 cores, the client's own start-up would compete with the server for CPU).
    """
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "stream": True}
    posted: dict[str, object] = {}
    poster = subprocess.Popen([sys.executable, "-c", POST_BIG_PROMPT,
                               server.url_for("v1/completions"), MODEL_NAME],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        assert poster.stdout.readline().strip() == "ready"

        def post_big_prompt() -> None:
            posted["start"] = time.monotonic()
            poster.stdin.write("go\n")
            poster.stdin.flush()
            posted["out"] = poster.stdout.readline().strip()
            posted["end"] = time.monotonic()

        sender = threading.Thread(target=post_big_prompt)
        arrivals: list[float] = []
        with httpx.stream("POST", server.url_for("v1/completions"), json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 12:  # well into the decode
                        sender.start()
        sender.join(300)
        posted["out"] += poster.communicate(timeout=60)[0]
    finally:
        if poster.poll() is None:
            poster.kill()
            poster.wait()
    status, message = str(posted["out"]).split(" ", 1)
    assert status == "400", posted["out"]
    assert "max_model_len" in json.loads(message), posted["out"]
    assert posted["end"] < arrivals[-1], "the 10 MB request outlasted the stream"
    gaps = [b - a for a, b in zip(arrivals[2:], arrivals[3:], strict=False)]
    median = statistics.median(gaps)
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)
              if b >= posted["start"] and a <= posted["end"]]
    assert during, "no token arrived while the 10 MB request was in flight"
    assert max(during) <= 2 * median + BIG_PROMPT_SLACK_S, (
        f"a gap of {max(during) * 1e3:.0f} ms while the 10 MB prompt was handled; "
        f"median {median * 1e3:.0f} ms"
    )


# ------------------------------------------------------------------ the engine core dies
def test_killed_engine_core_fails_requests_in_flight_and_exits():
    """SIGKILL of the engine core process (it cannot report anything): the frontend's
    monitor sees the process end; a waiting non-streaming request gets 500 with the
    OpenAI body (vLLM's status for a dead engine), a running stream an SSE error event
    and then [DONE]; the server exits 1 and no process of its tree is left."""
    with RemoteServer(DEFAULT_SERVER_ARGS) as server:
        (core,) = [p for p in psutil.Process(server.proc.pid).children()
                   if "resource_tracker" not in " ".join(p.cmdline())]
        everything = tree(server)
        url = server.url_for("v1/completions")
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True}
        results: dict = {}

        def plain() -> None:
            results["plain"] = httpx.post(url, json=body, timeout=120)

        events: list[str] = []
        streamer, streaming = _stream_in_background(server, events)
        threads = [streamer, threading.Thread(target=plain)]
        threads[1].start()
        assert streaming.wait(120)
        core.send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "a request hangs after the engine core died"
        plain_response = results["plain"]
        assert plain_response.status_code == 500, plain_response.text
        assert "engine core process died (killed by SIGKILL)" in error_of(
            plain_response)["message"]
        assert events[-1] == "data: [DONE]", events[-3:]
        error_event = json.loads(events[-2].removeprefix("data: "))
        assert error_event["error"]["code"] == 500, events[-2]
        assert "engine core process died" in error_event["error"]["message"]
        with contextlib.suppress(httpx.ConnectError):  # it lingers a moment for probes
            health = httpx.get(server.url_for("health"), timeout=5)
            assert health.status_code == 503
            assert "engine core process died" in error_of(health)["message"]
        assert server.proc.wait(30) == 1
    wait_gone(everything)
