"""benchmarks/common.py's `ServeProcess` against a stand-in server (a few lines of
http.server that logs "listening on URL" as `vllm serve` does): the URL read from the
log, a start-up failure reported with the log's tail, and a stop that leaves nothing
of the process group behind (a child that ignores SIGTERM included)."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from benchmarks.common import ServeProcess

# argv: --host H --port P [--child] [--fail]. --child: a grandchild that ignores SIGTERM
# (an engine core that outlives its frontend); --fail: exit 3 before listening.
FAKE_SERVER = r"""
import http.server, signal, subprocess, sys
if "--fail" in sys.argv:
    print("model load failed: no such file", flush=True)
    sys.exit(3)
if "--child" in sys.argv:
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(f"child {child.pid}", flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

host = sys.argv[sys.argv.index("--host") + 1]
port = int(sys.argv[sys.argv.index("--port") + 1])
server = http.server.HTTPServer((host, port), Health)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(f"listening on http://{host}:{server.server_address[1]}", flush=True)
server.serve_forever()
"""
COMMAND = (sys.executable, "-c", FAKE_SERVER)


def _child_pid(server: ServeProcess) -> int:
    line = next(li for li in server.log().splitlines() if li.startswith("child "))
    return int(line.split()[1])


def _gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_the_url_comes_from_the_log_and_stop_ends_the_whole_group():
    with ServeProcess(["--child"], command=COMMAND) as server:
        url = server.wait_ready(30)
        assert url.startswith("http://127.0.0.1:") and url == server.url
        assert "listening on " + url in server.startup_log
        child = _child_pid(server)
        assert os.getpgid(child) == server.proc.pid  # a group of its own
        assert server.stop(10) == 0  # the server itself left on SIGTERM
        assert _gone(child), "the child that ignored SIGTERM was left behind"
    assert not os.path.exists(server.log_path)  # the temporary log is removed


def test_a_server_that_ignores_sigterm_is_killed_after_the_timeout():
    ignore = FAKE_SERVER.replace("lambda *_: sys.exit(0)", "signal.SIG_IGN")
    with ServeProcess([], command=(sys.executable, "-c", ignore)) as server:
        server.wait_ready(30)
        assert server.stop(0.5) == -signal.SIGKILL


def test_an_exit_during_start_up_is_reported_with_the_log_tail(tmp_path):
    log = tmp_path / "server.log"
    server = ServeProcess(["--fail"], command=COMMAND, log_path=log)
    with pytest.raises(RuntimeError, match="exited with 3 during start-up") as info:
        server.wait_ready(30)
    assert str(log) in str(info.value)  # a log the caller keeps is named ...
    assert str(info.value).endswith("model load failed: no such file\n")  # ... and quoted
    assert log.exists()


def test_a_known_url_is_polled_until_the_timeout():
    # url given: no --host/--port added, nothing listens there -> the timeout's message.
    server = ServeProcess([], command=(sys.executable, "-c", "import time; time.sleep(60)"),
                          url="http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match=r"never answered /health with 200 within 1 s"):
        server.wait_ready(1)
    assert server.proc.returncode is not None
