"""What-if model of benchmark_elastic.py's loads: the real scheduler, elastic policy,
controller and device registry, on a modelled device. A model, not a measurement.

Each engine is a real `Scheduler` (static: a fixed block count; elastic: an
`ElasticKVPolicy` and an `ElasticKVController` joined to a real device registry
in a temporary directory). The workers are modelled: they share one pool of
blocks (the device's KV memory) and a growth that fits ends by the next step.
The device runs one engine's step at a time, in turn, and a step takes

    step_s = fixed_s + context tokens x kv_bytes_per_token / bandwidth
             + prefill tokens x prefill_token_s

(a decode step reads the weights (`fixed_s`) and every running request's KV;
prefill chunks add compute). Arrivals are `elastic_loads.make_plan`'s, the
same as `benchmark_elastic.py --seed` sends. Defaults model the Llama-3-8B
shape on an H100 emulated at 58 GiB (`--device-gib 58`): 2 MiB blocks, a
static engine of 4,577 blocks (8.94 GiB), a pool of 10,976 (21.4 GiB, what
the two elastic engines held together on 2026-12-07), 5.4 ms per step plus
the KV at 3.0 TB/s. With them the static run of the full decode-heavy
Poisson load reads 86 s, TTFT p50 / p99 11.8 / 30.5 s and 281 + 280
preemptions; the H100 measured 99.6 s, 16.6 / 32.4 s and 269 + 290
(benchmarks/results/elastic_n2_8b_decode_poisson_full_h100_2026-12-07.json).

Use it for what the scheduler and the policy do with a load (bounds, orders,
splits) when no device is at hand; quote measurements, not this.

    python benchmarks/elastic_sim.py                         # static vs elastic
    python benchmarks/elastic_sim.py --static-blocks 4577 5488 8000   # more KV, static
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

from elastic_loads import LOADS, PATTERNS, make_plan

from vllm import envs
from vllm.benchmarks.utils import positive_float, positive_int
from vllm.sampling_params import SamplingParams
from vllm.v1.core.elastic import ElasticKVPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.elastic_kv import ElasticKVController
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.worker.elastic_kv_cache import (
    elastic_chunk_blocks,
    elastic_piece_blocks,
    growth_points,
)
from vllm.v1.worker.gpu_worker import Worker

BLOCK_SIZE = 16
_RUNS = itertools.count()  # each run's engines: a device key of their own
IDLE_POLL_S = 0.05
# The loads' prompts in the 8B shape's tokens (their words x ~4.46, as the H100 runs'
# /tokenize read them: ~2,900 and ~450).
PROMPT_TOKENS = {"prefill-heavy": 2900, "decode-heavy": 450}


@dataclass(frozen=True)
class DeviceModel:
    """The modelled device and engine shape (defaults: the 8B shape, H100, see above)."""

    fixed_s: float = 5.4e-3
    kv_bytes_per_token: int = 128 * 1024
    bandwidth: float = 3.0e12
    prefill_token_s: float = 0.03e-3
    pool_blocks: int = 10_976
    floor_blocks: int = 288
    limit_blocks: int = 31_712

    def step_s(self, scheduler: Scheduler, num_scheduled: dict[str, int]) -> float:
        context = prefill = 0
        for req_id, n in num_scheduled.items():
            context += scheduler.requests[req_id].num_computed_tokens
            prefill += n if n > 1 else 0
        return (self.fixed_s + context * self.kv_bytes_per_token / self.bandwidth
                + prefill * self.prefill_token_s)


class ModelledWorker:
    """A worker's elastic-cache calls against the shared pool (`pool[name]`: its blocks).
    A growth asked for ahead ends by the next call, up to what is free then."""

    def __init__(self, pool: dict[str, int], total: int, name: str, device: DeviceModel,
                 key: str = "modelled-device"):
        self.pool, self.total, self.name, self.key = pool, total, name, key
        self.floor, self.limit = device.floor_blocks, device.limit_blocks
        self.chunk = elastic_chunk_blocks(self.floor, self.limit)
        self.piece = elastic_piece_blocks(self.chunk)
        self.block_bytes = BLOCK_SIZE * device.kv_bytes_per_token
        self.ends: list[int] = []
        self.pending: int | None = None
        pool[name] = self.floor

    @property
    def committed(self) -> int:
        return self.pool[self.name]

    def _fits(self, target: int) -> int:
        return min(target, self.limit, self.committed + self.total - sum(self.pool.values()))

    def _extend(self, target: int) -> None:
        target = self._fits(target)
        if target > self.committed:
            self.ends += [p for p in growth_points(self.floor, self.piece, self.committed,
                                                   target)] + [target]
            self.pool[self.name] = target

    def call(self, method, args: tuple) -> object:
        """One rank's answer to `collective_rpc(method, args)`; `method` is the `Worker`
        function the controller passes (matched by identity: a renamed one raises here)."""
        ends = lambda: [e for e in self.ends if e < self.committed]
        if method is Worker.kv_cache_device:
            return self.key, self.block_bytes
        if method is Worker.grow_kv_cache_ahead:
            if self.pending is not None:
                self._extend(self.pending)
                self.pending = None
            elif self._fits(args[0]) > self.committed:
                self.pending = args[0]
                return self.committed, True, ends()
            return self.committed, False, ends()
        if method is Worker.grow_kv_cache:
            self._extend(args[0])
            return self.committed, ends()
        if method is Worker.shrink_kv_cache:
            keep = max(args[0], self.floor)
            if keep < self.committed:
                self.pool[self.name] = keep
                self.ends = [e for e in self.ends if e <= keep]
            return self.committed
        if method is Worker.move_kv_blocks:
            return None
        raise NotImplementedError(getattr(method, "__qualname__", method))


@dataclass
class Engine:
    scheduler: Scheduler
    controller: ElasticKVController | None
    arrivals: list[tuple[float, str]]  # (send time, wave-index key), in send order
    next_arrival: int = 0
    sent: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)


def make_engines(mode: str, num_engines: int, device: DeviceModel, static_blocks: int,
                 shrink_delay_s: float, clock) -> list[Engine]:
    pool: dict[str, int] = {}
    engines = []
    key = f"modelled-device-{os.getpid()}-{next(_RUNS)}"
    for i in range(num_engines):
        kwargs = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
                      block_size=BLOCK_SIZE, enable_prefix_caching=True)
        controller = None
        if mode == "static":
            scheduler = Scheduler(num_blocks=static_blocks, **kwargs)
        else:
            worker = ModelledWorker(pool, device.pool_blocks, f"engine{i}", device, key)
            policy = ElasticKVPolicy(committed=worker.floor, floor=worker.floor,
                                     limit=worker.limit, chunk=worker.chunk,
                                     shrink_delay_s=shrink_delay_s, clock=clock)
            scheduler = Scheduler(num_blocks=worker.floor, elastic=policy, **kwargs)
            controller = ElasticKVController(
                scheduler, lambda m, args=(), w=worker: [w.call(m, args)], f"engine{i}", clock)
        engines.append(Engine(scheduler, controller, []))
    return engines


def _admit(i: int, e: Engine, now: float, prompt_len: int, max_tokens: int) -> None:
    while e.next_arrival < len(e.arrivals) and e.arrivals[e.next_arrival][0] <= now:
        at, key = e.arrivals[e.next_arrival]
        e.next_arrival += 1
        req_id = f"{i}-{key}"
        first = 1000 + e.next_arrival * prompt_len  # no two prompts share a prefix
        prompt = list(range(first, first + prompt_len))
        e.scheduler.add_request(Request(req_id, prompt, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), None, arrival_time=at))
        e.sent[req_id] = at


def _step(e: Engine, device: DeviceModel, clock: list[float]) -> bool:
    """One step of `e` on the device (adjust first, as the engine core does)."""
    s = e.scheduler
    if e.controller is not None:
        e.controller.adjust()
    if not s.has_requests():
        return False
    so = s.schedule()
    if not so.num_scheduled_tokens:
        return False
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
               for r in ids]
    clock[0] += device.step_s(s, so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={})
    for o in s.update_from_output(so, out):
        if o.new_token_ids:
            e.first.setdefault(o.request_id, clock[0])
        if o.finish_reason is not None:
            e.done[o.request_id] = clock[0]
    return True


def simulate(mode: str, load: str = "decode-heavy", pattern: str = "poisson",
             scale: float = 1.0, seed: int = 0, device: DeviceModel = DeviceModel(),
             static_blocks: int = 4577, shrink_delay_s: float = 2.0, gap_s: float = 4.0,
             prompt_len: int | None = None, max_tokens: int | None = None) -> dict:
    """One run of two engines under `mode` ("static" or "elastic"); returns its summary
    (seconds, output tokens/s, TTFT p50 / p99 in s, preemptions, per engine too).

    The plan's waves run one after the other, `gap_s` apart (as `benchmark_elastic.py`
    sends them); while nothing runs the elastic engines adjust every `IDLE_POLL_S`.
    """
    spec = LOADS[load]
    max_tokens = max_tokens or spec.max_tokens
    prompt_len = prompt_len or PROMPT_TOKENS[load]
    plan = make_plan(spec, pattern, 2, scale=scale, bursts=2, phase_s=10.0, seed=seed)
    clock = [0.0]
    with _own_registry():
        engines = make_engines(mode, 2, device, static_blocks, shrink_delay_s,
                               lambda: clock[0])
        _run_plan(plan, engines, device, clock, gap_s, prompt_len, max_tokens)
    return summarize(mode, engines, max_tokens)


@contextmanager
def _own_registry():
    """The run's device registry in a temporary directory (VLLM_KV_REGISTRY_DIR for its
    duration; `envs` re-reads it), and the engines' INFO lines off (every release logs
    one)."""
    logger, before = logging.getLogger("vllm"), os.environ.get("VLLM_KV_REGISTRY_DIR")
    level = logger.level
    with tempfile.TemporaryDirectory(prefix="elastic-sim-") as directory:
        os.environ["VLLM_KV_REGISTRY_DIR"] = directory
        envs.reset()
        logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.setLevel(level)
            if before is None:
                del os.environ["VLLM_KV_REGISTRY_DIR"]
            else:
                os.environ["VLLM_KV_REGISTRY_DIR"] = before
            envs.reset()


def _run_plan(plan, engines: list[Engine], device: DeviceModel, clock: list[float],
              gap_s: float, prompt_len: int, max_tokens: int) -> None:
    try:
        for k, wave in enumerate(plan):
            if k:
                _idle(engines, clock, clock[0] + gap_s)
            for i, stream in wave.streams.items():
                engines[i].arrivals += sorted((clock[0] + a.at_s, f"{k}-{n}")
                                              for n, a in enumerate(stream))
            _run_wave(engines, device, clock, prompt_len, max_tokens)
    finally:
        for e in engines:
            if e.controller is not None:
                e.controller.close()


def _run_wave(engines: list[Engine], device: DeviceModel, clock: list[float],
              prompt_len: int, max_tokens: int) -> None:
    while True:
        for i, e in enumerate(engines):
            _admit(i, e, clock[0], prompt_len, max_tokens)
        if any([_step(e, device, clock) for e in engines]):
            continue
        pending = [e.arrivals[e.next_arrival][0] for e in engines
                   if e.next_arrival < len(e.arrivals)]
        if not pending and not any(e.scheduler.has_requests() for e in engines):
            return
        _idle(engines, clock, min(pending, default=clock[0] + IDLE_POLL_S))


def _idle(engines: list[Engine], clock: list[float], until: float) -> None:
    """Nothing to run until `until`: the engine loops' idle polls (elastic: adjust)."""
    while True:
        clock[0] = min(clock[0] + IDLE_POLL_S, max(until, clock[0]))
        for e in engines:
            if e.controller is not None:
                e.controller.adjust()
        if clock[0] >= until:
            return


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(int(len(xs) * q), len(xs) - 1)], 3)


def summarize(mode: str, engines: list[Engine], max_tokens: int) -> dict:
    ttfts = {n: [e.first[r] - e.sent[r] for r in e.sent]
             for n, e in zip("AB", engines, strict=True)}
    end = max(max(e.done.values()) for e in engines)
    everyone = [t for ts in ttfts.values() for t in ts]
    return {
        "mode": mode, "duration_s": round(end, 2),
        "output_throughput": round(len(everyone) * max_tokens / end, 1),
        "ttft_s_p50": _pct(everyone, 0.5), "ttft_s_p99": _pct(everyone, 0.99),
        "preemptions": sum(e.scheduler.num_preemptions for e in engines),
        "engines": {n: {"ttft_s_p50": _pct(ttfts[n], 0.5), "ttft_s_p99": _pct(ttfts[n], 0.99),
                        "preemptions": e.scheduler.num_preemptions,
                        "end_s": round(max(e.done.values()), 2)}
                    for n, e in zip("AB", engines, strict=True)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", choices=list(LOADS), default="decode-heavy",
                   help="benchmark_elastic.py's load (default: %(default)s)")
    p.add_argument("--pattern", choices=list(PATTERNS), default="poisson",
                   help="benchmark_elastic.py's arrival pattern (default: %(default)s)")
    p.add_argument("--scale", type=positive_float, default=1.0,
                   help="multiplies the load's request count (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts' and arrivals' seed, as benchmark_elastic.py's")
    p.add_argument("--modes", nargs="+", choices=["static", "elastic"],
                   default=["static", "elastic"], help="what to model (default: both)")
    p.add_argument("--static-blocks", type=positive_int, nargs="+", default=[4577],
                   help="blocks of each static engine; several: one static run each "
                        "(default: %(default)s, 8.94 GiB of the 8B shape's 2 MiB blocks)")
    p.add_argument("--pool-blocks", type=positive_int, default=DeviceModel.pool_blocks,
                   help="blocks the elastic engines share (default: %(default)s)")
    args = p.parse_args(argv)
    device = DeviceModel(pool_blocks=args.pool_blocks)
    runs = []
    for mode in args.modes:
        for blocks in (args.static_blocks if mode == "static" else [None]):
            r = simulate(mode, args.load, args.pattern, args.scale, args.seed, device,
                         static_blocks=blocks or 0)
            runs.append({"static_blocks": blocks, **r} if blocks else r)
    base = runs[0]
    for r in runs[1:]:
        r["over_first"] = {k: round(r[k] / base[k], 3) for k in
                           ("output_throughput", "ttft_s_p99")}
    print(json.dumps({"model": "simulated (benchmarks/elastic_sim.py)", "runs": runs},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
