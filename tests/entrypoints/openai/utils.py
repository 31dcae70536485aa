"""`RemoteServer`: a real `vllm serve` subprocess on loopback, for the server tests.

The server is started with `--port 0`; its URL is read from the log line the
server prints last at start-up ("... listening on http://HOST:PORT"), so
tests never race for a free port. Starting, waiting and stopping are
`benchmarks/common.py`'s `ServeProcess` (the benchmarks start their servers the
same way); this adds the tests' defaults and clients.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from benchmarks.common import VLLM_SERVE, ServeProcess

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
# Model load + KV cache sizing + warmup on 2 shared CPU cores, then /health.
_START_TIMEOUT_S = 330


class RemoteServer(ServeProcess):
    """Start `python -m vllm.entrypoints.cli.main serve ARGS` and wait until /health is 200.

    Args:
        args: arguments after `serve` (`--host 127.0.0.1 --port 0` are added).
        env: extra environment variables (PYTHONPATH starts with the repository root).
        launcher: the script to run instead of the CLI module (fault injection).
        new_session: start it in a session (and process group) of its own, as a
            service manager does; `signal_group` then signals every process in it.
            By default it shares pytest's group.
        verify: httpx's `verify` for an HTTPS server (an `ssl.SSLContext` trusting
            its certificate).

    Raises:
        RuntimeError: the server exited or did not become healthy in time; the
            message holds the tail of its log.
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 launcher: str | None = None, new_session: bool = False,
                 verify=True) -> None:
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        command = [sys.executable, launcher, "serve"] if launcher else VLLM_SERVE
        super().__init__(args, env={"PYTHONPATH": path, **(env or {})}, command=command,
                         cwd=REPO_ROOT, new_session=new_session)
        self.verify = verify
        self.wait_ready(_START_TIMEOUT_S, verify=verify)

    # ---------------------------------------------------------------- helpers
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

    # ---------------------------------------------------------------- stopping
    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, wait, return the exit code (kills it if it hangs and raises
        AssertionError with the end of its log, so a hang fails the test and says
        where the server was)."""
        self.request_stop()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            tail = "\n".join(self.log().splitlines()[-40:])
            self.stop(timeout_s=0)
            raise AssertionError(f"the server did not exit within {timeout} s of SIGTERM; "
                                 f"its log ends:\n{tail}") from e

    def close(self) -> None:
        """`terminate()` (a hang fails the test), then remove the log."""
        try:
            self.terminate()
        finally:
            super().close()

    def signal_group(self, sig: int) -> None:
        """`kill -- -PGID`: `sig` to every process of the server's group (`new_session`)."""
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL to the server process alone (what a crash looks like to its children)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


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
