"""How much does committing memory through the VMM driver cost, and is growth as cheap as
the classic allocate + zero?

Prints JSON (and writes it to --out):
  * "commit": latency of one create + map + set_access (and of unmap + release)
    by chunk size, with the implied GiB/s;
  * "grow": time for ExtensibleTensor.grow_segments_ to grow by N bytes
    *including zeroing*, next to `torch.empty(N, dtype=uint8).zero_()` of the
    same size (a fresh allocation: the caching allocator is emptied first),
    measured in the same run, and their ratio.

Backends are chosen automatically: CUDA (cuMem*) where torch sees an NVIDIA GPU,
otherwise the host backend (mmap/mprotect) with smaller sizes. Target on an
H200: growing by >= 8 GiB costs at most 1.2x the classic path.

On the host, committing only changes page protections; the pages are faulted
in on first touch, which the classic path pays inside `zero_()`. So the host
"grow" rows also report `extensible_touch_s`: growth plus the first write of
every new byte, the like-for-like comparison there.

Usage:
    python benchmarks/benchmark_vmm.py [--out FILE] [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import vllm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.benchmarks.utils import positive_int
from vllm.platforms import current_platform
from vllm.utils.extensible_tensor import ExtensibleTensor

MiB, GiB = 1 << 20, 1 << 30

GPU_CHUNKS = [2 * MiB, 8 * MiB, 32 * MiB, 128 * MiB, 512 * MiB, 1 * GiB, 2 * GiB, 4 * GiB,
              8 * GiB]
GPU_GROWTHS = [1 * GiB, 8 * GiB, 64 * GiB]
HOST_CHUNKS = [2 * MiB, 8 * MiB, 32 * MiB, 128 * MiB, 512 * MiB]
HOST_GROWTHS = [64 * MiB, 256 * MiB, 1 * GiB]
TARGET_RATIO = 1.2  # at >= 8 GiB on the H200
TARGET_MIN_GROWTH = 8 * GiB


def _sig(x: float) -> float:
    """Four significant digits (ratios of microseconds to seconds stay readable)."""
    return float(f"{x:.4g}")


def _fmt(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB"


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def _free_bytes(on_gpu: bool) -> int:
    return current_platform.mem_get_info(torch.cuda.current_device() if on_gpu else 0)[0]


def bench_commit(driver, chunks: list[int], repeats: int, on_gpu: bool) -> list[dict]:
    """Median latency of create+map+set_access and of unmap+release per chunk size."""
    rows = []
    fits = [c for c in chunks if c <= 0.8 * _free_bytes(on_gpu)]
    if not fits:
        return rows
    span = max(fits)
    va = driver.reserve(span)
    try:
        for size in fits:
            commit, drop = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                h = driver.create(size)
                driver.map(va, size, h)
                driver.set_access(va, size)
                t1 = time.perf_counter()
                driver.unmap(va, size)
                driver.release(h)
                t2 = time.perf_counter()
                commit.append(t1 - t0)
                drop.append(t2 - t1)
            c = statistics.median(commit)
            rows.append({
                "chunk": _fmt(size), "chunk_bytes": size,
                "commit_us": round(c * 1e6, 1),
                "commit_gib_s": round(size / GiB / c, 1),
                "release_us": round(statistics.median(drop) * 1e6, 1),
            })
    finally:
        driver.free_reservation(va, span)
    return rows


def _classic(n: int, device: torch.device, on_gpu: bool) -> float:
    if on_gpu:
        torch.cuda.empty_cache()
    _sync(on_gpu)
    t0 = time.perf_counter()
    x = torch.empty(n, dtype=torch.uint8, device=device)
    x.zero_()
    _sync(on_gpu)
    elapsed = time.perf_counter() - t0
    del x
    if on_gpu:
        torch.cuda.empty_cache()
    return elapsed


def _extensible(n: int, driver, on_gpu: bool, touch: bool) -> float:
    g = driver.granularity
    et = ExtensibleTensor([g + n], driver)  # reserving is start-up work, not timed
    try:
        et.grow_segments_([g])  # the warmup prefix
        _sync(on_gpu)
        t0 = time.perf_counter()
        et.grow_segments_([g + n], zero_new=True)
        if touch:
            et.segment_view(0)[g:].fill_(1)
        _sync(on_gpu)
        return time.perf_counter() - t0
    finally:
        et.free()


def bench_grow(driver, growths: list[int], repeats: int, on_gpu: bool) -> list[dict]:
    """Growth by n bytes including zeroing vs torch.empty(n).zero_(), same run."""
    device = driver.device
    rows = []
    for n in growths:
        if n + 2 * driver.granularity > 0.9 * _free_bytes(on_gpu):
            rows.append({"grow": _fmt(n), "grow_bytes": n, "skipped": "does not fit"})
            continue
        reps = max(1, repeats if n < 32 * GiB else repeats // 2)
        _classic(min(n, 64 * MiB), device, on_gpu)  # warm the kernels up
        classic = statistics.median(_classic(n, device, on_gpu) for _ in range(reps))
        ext = statistics.median(_extensible(n, driver, on_gpu, False) for _ in range(reps))
        row = {
            "grow": _fmt(n), "grow_bytes": n,
            "extensible_s": _sig(ext), "classic_s": _sig(classic),
            "ratio": _sig(ext / classic),
            "classic_gib_s": round(n / GiB / classic, 1),
        }
        if driver.fresh_pages_zeroed:  # host: pages fault in on first touch; compare that too
            touch = statistics.median(_extensible(n, driver, on_gpu, True) for _ in range(reps))
            row["extensible_touch_s"] = _sig(touch)
            row["touch_ratio"] = _sig(touch / classic)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON to this file")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="runs per measurement (median)")
    parser.add_argument("--quick", action="store_true", help="smallest sizes only (smoke test)")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available() and torch.version.hip is None
    index = torch.cuda.current_device() if on_gpu else 0
    driver = current_platform.get_vmm_driver(index)
    reason = driver.probe()
    if reason is not None:
        raise SystemExit(f"VMM driver unusable here: {reason}")
    chunks = GPU_CHUNKS if on_gpu else HOST_CHUNKS
    growths = GPU_GROWTHS if on_gpu else HOST_GROWTHS
    if args.quick:
        chunks, growths = chunks[:3], growths[:1]

    result = {
        "backend": type(driver).__name__,
        "device": torch.cuda.get_device_name(index) if on_gpu else "cpu",
        "torch": torch.__version__,
        "granularity_bytes": driver.granularity,
        "repeats": args.repeats,
        "commit": bench_commit(driver, chunks, args.repeats, on_gpu),
        "grow": bench_grow(driver, growths, args.repeats, on_gpu),
    }
    big = [r for r in result["grow"] if "ratio" in r and r["grow_bytes"] >= TARGET_MIN_GROWTH]
    result["target"] = {
        "max_ratio_at_or_above_8_gib": TARGET_RATIO,
        "worst_ratio": max((r["ratio"] for r in big), default=None),
        "met": all(r["ratio"] <= TARGET_RATIO for r in big) if big else None,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
