"""Shared pieces of the benchmarks: model shapes, model directories, copy bandwidth."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.model_dirs import llama3_8b_config, make_model_dir, smollm2_config  # noqa: E402
from tests.multimodal.qwen2_vl_checkpoint import (  # noqa: E402
    make_qwen2_vl_config_dir,
    qwen2_vl_2b_config,
)

SHAPES = {"smollm2": smollm2_config, "llama3_8b": llama3_8b_config}
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


def emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        Path(out).write_text(text)
