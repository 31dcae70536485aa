"""`RemoteServer`: a real `vllm serve` subprocess on loopback, for the server tests.

The server is started with `--port 0`; its URL is read from the log line the
server prints last at start-up ("... listening on http://HOST:PORT"), so
tests never race for a free port.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_NAME = "SmolLM2-135M-Instruct"
# Small and fast on CPU; the tests' prompts and max_tokens fit easily.
MAX_MODEL_LEN = 512
# A small token budget keeps start-up (profiling and warmup run a worst-case batch) short
# on CPU, and an explicit KV size keeps several servers' memory small.
ENGINE_KWARGS = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 32,
                 "max_num_batched_tokens": 128, "kv_cache_memory_bytes": 256 * 2**20}
DEFAULT_SERVER_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
    "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", "256MiB",
    "--uvicorn-log-level", "warning", "--disable-log-stats",
]
_URL_LINE = re.compile(r"listening on (https?://\S+)")
# Model load + KV cache sizing + warmup on 2 shared CPU cores.
_START_TIMEOUT_S = 300


class RemoteServer:
    """Start `python -m vllm.entrypoints.cli.main serve ARGS` and wait until /health is 200.

    Args:
        args: arguments after `serve` (`--port 0` is added).
        env: extra environment variables.
        launcher: the script to run instead of the CLI module (fault injection).
        new_session: start it in a session (and process group) of its own, as a
            service manager does; `signal_group` then signals every process in it.
        verify: httpx's `verify` for an HTTPS server (an `ssl.SSLContext` trusting
            its certificate).

    Raises:
        RuntimeError: the server exited or did not become healthy in time; the
            message holds the tail of its log.
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 launcher: str | None = None, new_session: bool = False,
                 verify=True) -> None:
        self.verify = verify
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="vllm-serve-", suffix=".log", delete=False)
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        full_env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
        entry = [launcher] if launcher else ["-m", "vllm.entrypoints.cli.main"]
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "serve", *args, "--host", "127.0.0.1", "--port", "0"],
            cwd=REPO_ROOT, env=full_env, stdout=self.log_file, stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
        self.url = self._wait_for_url()
        self.startup_log = self.log()
        self._wait_for_health()

    # ---------------------------------------------------------------- helpers
    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *[p.strip("/") for p in parts]])

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def get_client(self, api_key: str = "EMPTY", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=api_key, max_retries=0,
                             timeout=120, **kwargs)

    def get_async_client(self, api_key: str = "EMPTY", **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=api_key, max_retries=0,
                                  timeout=120, **kwargs)

    def _fail(self, what: str) -> RuntimeError:
        self.kill()
        return RuntimeError(f"vllm serve {what}; log tail:\n{self.log()[-4000:]}")

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = _URL_LINE.search(self.log())
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode} during start-up")
            time.sleep(0.2)
        raise self._fail(f"printed no URL within {_START_TIMEOUT_S} s")

    def _wait_for_health(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url_for("health"), timeout=5,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise self._fail("never answered /health with 200")

    # ---------------------------------------------------------------- stopping
    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, wait, return the exit code (kills it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def signal_group(self, sig: int) -> None:
        """`kill -- -PGID`: `sig` to every process of the server's group (`new_session`)."""
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def close(self) -> None:
        try:
            self.terminate()
        finally:
            self.kill()
            self.log_file.close()
            os.unlink(self.log_file.name)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of a response; asserts the body has exactly its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == response.status_code, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def scrape_metrics(server: RemoteServer) -> dict[str, float]:
    """`/metrics` parsed by prometheus-client: {"name{label=value,...}": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url_for("metrics"), timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
