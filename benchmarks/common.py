"""Shared pieces of the benchmarks: model shapes, model directories, copy bandwidth, and
`ServeProcess`, the one way a script starts, waits for and stops a server."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.model_dirs import (  # noqa: E402
    llama3_8b_config,
    llama_config,
    make_model_dir,
    smollm2_config,
)
from tests.multimodal.qwen2_vl_checkpoint import (  # noqa: E402
    make_qwen2_vl_config_dir,
    qwen2_vl_2b_config,
)


def llama3_2_1b_config():
    """Llama-3.2-1B's shape: 16 layers, 32 query / 8 KV heads of 64, tied embeddings,
    Llama 3 rope scaling (factor 32 over 8192 positions)."""
    return llama_config(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )


def qwen2_5_0_5b_config():
    """Qwen2.5-0.5B's shape: 24 layers, 14 query / 2 KV heads of 64, q/k/v bias, tied
    embeddings, rope theta 1e6."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


SHAPES = {"smollm2": smollm2_config, "llama3_8b": llama3_8b_config,
          "llama3_2_1b": llama3_2_1b_config, "qwen2_5_0_5b": qwen2_5_0_5b_config}
# Image-taking shapes (their directories also hold the image processor's config).
MULTIMODAL_SHAPES = {"qwen2_vl_2b": qwen2_vl_2b_config}


def model_dir_for(shape: str) -> str:
    """A config-only model directory for `shape` (load with load_format="dummy")."""
    directory = Path(tempfile.gettempdir()) / f"vllm-bench-{shape}-v2"
    if not (directory / "config.json").exists():
        if shape in MULTIMODAL_SHAPES:
            make_qwen2_vl_config_dir(directory, MULTIMODAL_SHAPES[shape]())
        else:
            make_model_dir(directory, SHAPES[shape](), weights=False)
    return str(directory)


def _event_time_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Mean milliseconds of one fn() call on the current CUDA stream, between CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth(
    size: int,
    time_ms: Callable[[Callable[[], object]], float] = _event_time_ms,
    device: str = "cuda",
) -> dict:
    """The device's copy bandwidth: `dst.copy_(src)` of two `size`-byte uint8 buffers.

    Convention (every benchmark here): bytes = 2 x size (each byte is read once
    and written once), bytes_per_s = 2 x size / time.

    Args:
        size: bytes of each buffer (src is filled with random bytes first).
        time_ms: milliseconds of one call of its argument; by default the mean
            of 20 back-to-back calls between CUDA events after 3 warm-ups
            (benchmark_attention passes triton's do_bench median instead).
        device: where the buffers live ("cpu" only for --smoke runs).

    Returns:
        {"bytes": 2 x size, "time_ms": ms per copy, "bytes_per_s": bytes / s}.
    """
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_once = partial(dst.copy_, src)
    ms = time_ms(copy_once)
    del src, dst, copy_once  # free the buffers before empty_cache
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": 2 * size, "time_ms": ms, "bytes_per_s": 2 * size / (ms * 1e-3)}


def copy_bandwidth_bytes_per_s(nbytes: int = 2 << 30) -> float:
    """`copy_bandwidth` of a buffer of nbytes / 2, so that `nbytes` bytes (read + write)
    move per copy; bytes per second (2 GiB counted by default: a 1 GiB buffer)."""
    return copy_bandwidth(nbytes // 2)["bytes_per_s"]


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    """`--smoke`: the Triton benchmarks' tiny-shape CPU run (see `smoke_env_problem`)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (code path only)",
    )


def smoke_env_problem(name: str) -> str | None:
    """Why `name --smoke` cannot run here (TRITON_INTERPRET=1 unset), or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return f"{name}: --smoke needs TRITON_INTERPRET=1 in the environment"
    return None


def no_gpu_message(name: str) -> str:
    """What a Triton benchmark says when run without --smoke on a machine with no CUDA GPU."""
    return (
        f"{name}: needs a CUDA GPU (torch.cuda.is_available() is False); "
        "nothing measured. On the CPU, TRITON_INTERPRET=1 ... --smoke runs the code path "
        "on tiny shapes."
    )


def emit(result: dict, out: str | os.PathLike | None, indent: int = 1) -> None:
    """Print `result` as JSON and, with `out`, also write it there (parents created)."""
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        Path(out).write_text(text + "\n")


VLLM_SERVE = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
_URL_LINE = re.compile(r"listening on (https?://\S+)")


class ServeProcess:
    """A server subprocess (by default `vllm serve ARGS`), its output in a log file.

    Start-up: `ServeProcess(args, ...)` starts it; `wait_ready(timeout_s)` returns its
    URL once it answers 200 on `/health` (or another path). Without `url` the server
    is given `--host 127.0.0.1 --port 0` and its URL is read from the line it logs last
    at start-up, "... listening on http://HOST:PORT" (`vllm serve` and
    `vllm.entrypoints.disagg_proxy` both print it), so no script races for a port.
    Stop: `stop()` sends SIGTERM (the API server drains and stops its engine core),
    SIGKILL to the whole process group after `timeout_s`, and then SIGKILL to anything
    of its group still alive (an engine core or worker that outlived its parent).

    Args:
        args: arguments after `command`.
        env: environment variables over `os.environ` (PYTHONUNBUFFERED=1 is added so
            the log is current).
        log_path: where stdout and stderr go; the caller keeps the file. Default: a
            temporary file that `close()` removes.
        command: the program and its leading arguments (default: `VLLM_SERVE`).
        url: the root URL when `args` fix the host and port themselves; None: add
            `--host 127.0.0.1 --port 0` and read it from the log.
        cwd: the working directory (default: the repository root).
        new_session: run it in a session (and process group) of its own, so that
            `stop()` reaches every process it started. False: it stays in the caller's
            group (Ctrl-C reaches it) and only the server process itself is killed.

    Attributes: `url` (once known), `startup_log` (the log when the URL line came),
    `proc` (the `subprocess.Popen`), `log_path`.
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 log_path: str | os.PathLike | None = None,
                 command: list[str] | tuple[str, ...] = VLLM_SERVE, url: str | None = None,
                 cwd: str | os.PathLike = ROOT, new_session: bool = True) -> None:
        self._own_log = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = str(log_path)
        self.url = url
        self.startup_log = ""
        self._new_session = new_session
        self._term_sent = False
        port = [] if url else ["--host", "127.0.0.1", "--port", "0"]
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [*command, *args, *port], cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session)

    def log(self) -> str:
        """Everything the server has written so far (stdout and stderr)."""
        return Path(self.log_path).read_text(errors="replace")

    def wait_ready(self, timeout_s: float, path: str = "/health", verify=True) -> str:
        """Block until the server answers HTTP 200 on `path`; return its URL.

        Args:
            timeout_s: seconds for all of start-up (the URL line and the 200).
            path: `/health`, or `/v1/models` for a server that has no /health.
            verify: httpx's `verify` (an `ssl.SSLContext` for an HTTPS server).

        Raises:
            RuntimeError: it exited or was not ready within `timeout_s`; it is
                stopped (`close()`), and the message ends with the last 4,000
                characters of its log.
        """
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.returncode} during start-up")
            if self.url is None and (match := _URL_LINE.search(text := self.log())):
                self.url, self.startup_log = match.group(1), text
            if self.url is not None:
                try:
                    if httpx.get(self.url.rstrip("/") + path, timeout=5,
                                 verify=verify).status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        what = "printed no URL" if self.url is None else f"never answered {path} with 200"
        raise self._failed(f"{what} within {timeout_s:g} s")

    def _failed(self, what: str) -> RuntimeError:
        self.stop(timeout_s=10)
        tail = self.log()[-4000:]
        self.close()
        kept = "" if self._own_log else f" ({self.log_path})"
        return RuntimeError(f"{' '.join(self.proc.args[:4])} ... {what}; the end of its "
                            f"log{kept}:\n{tail}")

    def request_stop(self) -> None:
        """SIGTERM to the server, once (a second SIGTERM is not sent by `stop()`), without
        waiting: several servers then drain at the same time."""
        if self.proc.poll() is None and not self._term_sent:
            self.proc.send_signal(signal.SIGTERM)
            self._term_sent = True

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (unless `request_stop` sent it), wait `timeout_s`, then SIGKILL to its
        process group; any process left in its group is killed too. Returns the exit code
        (negative: the signal that ended it). Safe to call again."""
        self.request_stop()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.proc.wait(30)
        self._kill_group()
        return self.proc.returncode

    def _kill_group(self) -> None:
        if not self._new_session:  # its group is the caller's: the server alone
            if self.proc.poll() is None:
                self.proc.kill()
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # none left in it
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """`stop()`, then remove the log if it is the temporary one."""
        try:
            self.stop()
        finally:
            if self._own_log:
                Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
