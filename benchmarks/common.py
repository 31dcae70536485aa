"""Shared pieces of the benchmarks: model shapes, model directories, copy bandwidth."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.model_dirs import llama3_8b_config, make_model_dir, smollm2_config  # noqa: E402

SHAPES = {"smollm2": smollm2_config, "llama3_8b": llama3_8b_config}


def model_dir_for(shape: str) -> str:
    """A config-only model directory for `shape` (load with load_format="dummy")."""
    directory = Path(tempfile.gettempdir()) / f"vllm-bench-{shape}-v2"
    if not (directory / "config.json").exists():
        make_model_dir(directory, SHAPES[shape](), weights=False)
    return str(directory)


def copy_bandwidth_bytes_per_s(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth counting read + write bytes (2 x size / time)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / seconds


def emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        Path(out).write_text(text)
