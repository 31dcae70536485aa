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


def emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        Path(out).write_text(text)
