"""Where a steady decode step's time goes: GPU kernels, GPU idle, host calls (CUDA).

Measure phases before optimizing (issue 10). An offline `LLM` (random
weights, bf16) holds `batch` requests in steady decode; after 10 steps it
times 60 engine steps without a profiler (`step_ms_median`, `step_ms_min`),
then runs `--steps` steps under torch.profiler (CUPTI records the kernels
inside the CUDA-graph replay as well) and reports, per step:

  kernels_per_step       CUDA kernels and memcpys (in and out of the graph)
  gpu_busy_ms_per_step   the union of their intervals: the device's own time
  gpu_busy_over_step     gpu_busy / step_ms_median: 1.0 = device-bound; below
                         it, the rest of the step is host work the device waits for
  kernels                by name: us per step, calls per step, mean us
  host_calls             the host functions with the most self time per step
                         (cudaGraphLaunch, cudaMemcpyAsync, aten ops; inflated
                         by the profiler itself, so read them as ranks)

    python benchmarks/benchmark_decode_profile.py --shape smollm2 --batch-sizes 1 32 \
        --out benchmarks/results/decode_profile.json

`--scheduling sync` profiles the synchronous loop, `--fused-linear` switches on
the 2..16-row norm / SiLU projection fusion (`layers/fused_linear.py`, off by
default; the one-row GEMV prologue runs either way);
`--trace-dir D` also writes a Chrome trace per configuration; `--host-profile`
adds `host_functions`: the same number of steps under cProfile, the Python
functions with the most cumulative time per step (cProfile slows the host
~1.3x: read them as shares, the unprofiled step times as the figures).
`--host-phases` adds `host_phases`: 200 more steps (before the profiled ones:
CUPTI slows every later CUDA call on the host) with perf_counter timers
around the step's phases (a timer costs well under a microsecond), each phase's
inclusive host microseconds per step, and `host_wait_us_per_step`, the time the
host spent blocked in CUDA event synchronizations (waiting for the device): a
host-bound step waits ~0, a device-bound one waits for the difference.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import pstats
import statistics
import time
from pathlib import Path

from common import SHAPES, emit, model_dir_for

from vllm.benchmarks.utils import positive_int

SCHEDULING = {"default": None, "sync": False, "async": True}


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


def _host_functions(profiler: cProfile.Profile, steps: int, top: int = 25) -> list[dict]:
    """The `top` functions by cumulative time: ms per step, calls per step, where."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][3])[:top]
    return [{"function": f"{file}:{line}({name})"[-110:],
             "cum_ms_per_step": round(1e3 * ct / steps, 3),
             "self_ms_per_step": round(1e3 * tt / steps, 3),
             "calls_per_step": round(nc / steps, 2)}
            for (file, line, name), (_, nc, tt, ct, _) in rows]


HOST_PHASE_STEPS = 200


def _time_host_phases(engine, steps: int = HOST_PHASE_STEPS) -> dict:
    """Host microseconds per step of each phase of `engine.step()` (inclusive, nested).

    Wraps the phases' methods on their instances (and torch.cuda.Event.synchronize
    on its class) with perf_counter timers for `steps` steps, then restores them.
    """
    import torch

    from vllm.v1.sample import sampler as sampler_module
    from vllm.v1.worker import async_output

    core = engine.engine_core  # in-process (the profiled engine runs one rank)
    runner = core.worker.model_runner
    totals: dict[str, float] = collections.defaultdict(float)
    restore = []

    def wrap(owner, attr: str, label: str) -> None:
        if owner is None or not hasattr(owner, attr):
            return
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0

        own = attr in vars(owner)  # an instance attribute (self.sampler), not a method
        setattr(owner, attr, timed)
        restore.append((owner, attr, original, own))

    wrap(engine, "step", "step")
    wrap(core.scheduler, "schedule", "scheduler.schedule")
    wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    wrap(core, "_execute", "execute (runner, via the executor)")
    wrap(engine.output_processor, "process_outputs", "output_processor.process_outputs")
    wrap(runner, "_update_states", "runner._update_states")
    wrap(runner, "_prepare_inputs", "runner._prepare_inputs")
    wrap(runner, "_forward", "runner._forward")
    wrap(runner.cuda_graphs, "replay", "runner._forward: graph replay")
    wrap(runner.model, "compute_logits", "compute_logits")
    wrap(runner, "sampler", "sampler")
    wrap(runner, "_sampling_metadata", "sampler: metadata")
    wrap(sampler_module, "argmax_rows", "sampler: argmax_rows")
    wrap(runner.input_batch.block_table, "copy_to_device", "runner._prepare_inputs: block table")
    if runner.async_state is not None:
        wrap(runner.async_state, "feed", "async: feed")
        wrap(runner.async_state, "output", "async: output (D2H copy launch)")
        wrap(async_output.AsyncRunnerOutput, "get_output", "async: get_output (incl. wait)")
    event_cls = torch.cuda.Event
    original_sync = event_cls.synchronize

    def timed_sync(self):
        t0 = time.perf_counter()
        try:
            return original_sync(self)
        finally:
            totals["host waits (Event.synchronize)"] += time.perf_counter() - t0

    event_cls.synchronize = timed_sync
    try:
        for _ in range(steps):
            engine.step()
    finally:
        event_cls.synchronize = original_sync
        for owner, attr, original, own in reversed(restore):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)  # the timer shadowed the class's method
    per_step = {label: round(1e6 * total / steps, 1) for label, total in totals.items()}
    return {"steps": steps,
            "host_wait_us_per_step": per_step.get("host waits (Event.synchronize)", 0.0),
            "us_per_step": dict(sorted(per_step.items(), key=lambda kv: -kv[1]))}


def profile_config(shape: str, batch: int, scheduling: str, fused_linear: bool, steps: int,
                   max_model_len: int, trace_dir: str | None, host_profile: bool = False,
                   host_phases: bool = False, max_num_seqs: int | None = None) -> dict:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm import LLM, SamplingParams
    from vllm.benchmarks.timing import random_token_prompts
    from vllm.model_executor.layers import fused_linear as fl
    from vllm.model_executor.layers.ops.norm_linear import MAX_ROWS

    prompt_len = 64
    # Every measured step must decode: 10 warm-up steps, 60 timed, the host phases,
    # the profiled steps and the cProfile'd ones, all within max_model_len.
    needed = prompt_len + 70 + (HOST_PHASE_STEPS if host_phases else 0) + steps * (
        2 if host_profile else 1)
    if needed > max_model_len:
        raise SystemExit(f"--max-model-len {max_model_len} is too short for the steps "
                         f"measured: a request would finish; use >= {needed}")
    saved = fl.FUSED_LINEAR_MAX_TOKENS
    fl.FUSED_LINEAR_MAX_TOKENS = MAX_ROWS if fused_linear else saved
    try:
        llm = LLM(model_dir_for(shape), load_format="dummy", dtype="bfloat16",
                  max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs or max(batch, 1),
                  async_scheduling=SCHEDULING[scheduling])
        engine = llm.llm_engine
        vocab = engine.vllm_config.model_config.get_vocab_size()
        llm.generate(random_token_prompts(batch, prompt_len, vocab, 1),
                     SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        # Long enough that no request finishes while measured.
        params = SamplingParams(max_tokens=max_model_len - prompt_len, temperature=0,
                                ignore_eos=True)
        for i, prompt in enumerate(random_token_prompts(batch, prompt_len, vocab, 2)):
            engine.add_request(f"profiled-{i}", prompt, params)
        for _ in range(10):
            engine.step()
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        # Before the profiler: once CUPTI has been attached, every CUDA call on
        # the host stays slower for the rest of the process.
        phases = _time_host_phases(engine) if host_phases else None
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        host = None
        if host_profile:
            host_profiler = cProfile.Profile()
            host_profiler.enable()
            for _ in range(steps):
                engine.step()
            host_profiler.disable()
            host = _host_functions(host_profiler, steps)
        async_on = engine.vllm_config.scheduler_config.async_scheduling
        engine.shutdown()
        del llm, engine
    finally:
        fl.FUSED_LINEAR_MAX_TOKENS = saved
    gc.collect()
    torch.cuda.empty_cache()

    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    by_name = collections.defaultdict(list)
    for e in kernels:
        by_name[e.name[:100]].append(e.time_range.end - e.time_range.start)
    rows = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    calls = sorted((r for r in prof.key_averages() if r.device_type == DeviceType.CPU),
                   key=lambda r: -r.self_cpu_time_total)[:20]
    step_ms = 1e3 * statistics.median(times)
    busy_ms = _busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps / 1e3
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace_dir) / f"decode_{shape}_b{batch}_{scheduling}"
                                     f"{'_fused' if fused_linear else ''}.json"))
    return {
        "shape": shape, "batch": batch, "async_scheduling": async_on,
        "fused_linear": fused_linear,
        "step_ms_median": step_ms, "step_ms_min": 1e3 * min(times),
        "kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms_per_step": busy_ms,
        "gpu_busy_over_step": busy_ms / step_ms,
        "kernels": [{"name": name, "us_per_step": round(sum(d) / steps, 2),
                     "calls_per_step": round(len(d) / steps, 2),
                     "mean_us": round(statistics.mean(d), 2)} for name, d in rows[:30]],
        "host_calls": [{"name": r.key[:80],
                        "self_us_per_step": round(r.self_cpu_time_total / steps, 1),
                        "calls_per_step": round(r.count / steps, 2)} for r in calls],
        **({"host_functions": host} if host is not None else {}),
        **({"host_phases": phases} if phases is not None else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="smollm2", choices=list(SHAPES),
                        help="model shape (random weights, bf16)")
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 32],
                        help="requests in steady decode, one configuration each")
    parser.add_argument("--scheduling", nargs="+", choices=list(SCHEDULING), default=["default"],
                        help="engine runs: the default, sync (--no-async-scheduling) and/or "
                             "async (--async-scheduling)")
    parser.add_argument("--fused-linear", action="store_true",
                        help="switch on the 2..16-row norm / SiLU projection fusion "
                             "(off by default)")
    parser.add_argument("--steps", type=positive_int, default=30,
                        help="profiled steps per configuration")
    parser.add_argument("--max-model-len", type=positive_int, default=1024,
                        help="the engine's max_model_len (prompt + every step measured)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None,
                        help="the engine's max_num_seqs (default: the batch size; "
                             "benchmark_throughput.py runs at vLLM's 256)")
    parser.add_argument("--trace-dir", default=None,
                        help="also write a Chrome trace per configuration into this directory")
    parser.add_argument("--host-profile", action="store_true",
                        help="also profile the host side of the same steps with cProfile")
    parser.add_argument("--host-phases", action="store_true",
                        help="also time the step's host phases with perf_counter timers")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmark_decode_profile needs a CUDA GPU; nothing measured")
    emit({
        "device": torch.cuda.get_device_name(),
        "results": [profile_config(args.shape, b, s, args.fused_linear, args.steps,
                                   args.max_model_len, args.trace_dir, args.host_profile,
                                   args.host_phases, args.max_num_seqs)
                    for s in args.scheduling for b in args.batch_sizes],
    }, args.out)


if __name__ == "__main__":
    main()
