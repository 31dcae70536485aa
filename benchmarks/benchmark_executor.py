"""What one `collective_rpc` costs per engine step, by executor backend.

Question: how much does driving the workers through processes (mp) or Ray
actors add to every step, against calling the worker in-process (uni, the
peer measured in the same run)? The payload is a pickled stand-in for a
decode step's SchedulerOutput of `--num-reqs` requests (ids, one new token,
one block id each); the reply is `--num-reqs` sampled token ids from rank 0
only (`unique_reply_rank=0`, as the engine asks for `execute_model`).

    python benchmarks/benchmark_executor.py --backends uni mp ray --world-sizes 1 2

Prints JSON: per backend and world size, the median and p90 microseconds of
one call and the ratio of the median to uni's. Runs on the CPU (gloo is not
used: the calls do no collective), so it measures the transport alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import emit  # noqa: E402
from vllm.benchmarks.utils import positive_int  # noqa: E402
from vllm.config import ParallelConfig  # noqa: E402
from vllm.v1.worker.worker_base import rpc  # noqa: E402


class EchoWorker:
    """Stands in for the engine's Worker: takes the step's input, returns token ids."""

    def __init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker):
        self.rank = rank

    @rpc
    def execute_model(self, scheduler_output: dict) -> list[int] | None:
        return [len(r) for r in scheduler_output["req_ids"]] if self.rank == 0 else None


def fake_scheduler_output(num_reqs: int, step: int) -> dict:
    return {
        "req_ids": [f"cmpl-{i:032x}" for i in range(num_reqs)],
        "num_scheduled_tokens": dict.fromkeys(range(num_reqs), 1),
        "new_block_ids": [[step * num_reqs + i] for i in range(num_reqs)],
        "num_computed_tokens": [step + 100] * num_reqs,
    }


def measure(backend: str, world_size: int, num_reqs: int, calls: int) -> list[float]:
    from vllm.v1.executor import Executor

    parallel = ParallelConfig(world_size, backend, "benchmarks.benchmark_executor.EchoWorker")
    executor = Executor.get_class(SimpleNamespace(parallel_config=parallel))(
        SimpleNamespace(parallel_config=parallel))
    try:
        times = []
        for step in range(calls + 20):
            payload = fake_scheduler_output(num_reqs, step)
            start = time.perf_counter()
            executor.collective_rpc(EchoWorker.execute_model, args=(payload,),
                                    unique_reply_rank=0)
            if step >= 20:  # warm-up calls are not counted
                times.append((time.perf_counter() - start) * 1e6)
        return times
    finally:
        executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["uni", "mp", "ray"],
                        choices=["uni", "mp", "ray"],
                        help="executor backends to time (uni runs at world size 1 only)")
    parser.add_argument("--world-sizes", nargs="+", type=positive_int, default=[1, 2],
                        help="ranks per executor, one measurement each")
    parser.add_argument("--num-reqs", type=positive_int, default=256,
                        help="requests in the stand-in SchedulerOutput (payload size)")
    parser.add_argument("--calls", type=positive_int, default=500,
                        help="timed calls per backend and world size (after 20 untimed)")
    parser.add_argument("--out", type=str, default=None, help="also write the JSON here")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray, loopback
    results: dict[str, dict] = {}
    for backend in args.backends:
        for world_size in args.world_sizes:
            if backend == "uni" and world_size > 1:
                continue
            times = measure(backend, world_size, args.num_reqs, args.calls)
            results[f"{backend}/{world_size}"] = {
                "backend": backend,
                "world_size": world_size,
                "median_us": round(statistics.median(times), 1),
                "p90_us": round(statistics.quantiles(times, n=10)[-1], 1),
            }
    peer = results.get("uni/1", {}).get("median_us")
    for entry in results.values():
        entry["ratio_to_uni"] = round(entry["median_us"] / peer, 1) if peer else None
    report = {"num_reqs": args.num_reqs, "calls": args.calls, "results": results}
    emit(report, args.out, indent=2)


if __name__ == "__main__":
    main()
