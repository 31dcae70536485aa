"""Where a speculative decoding step's time goes, against a plain step (batch 1, CUDA).

Issue 50 item 4: on the H100 the async spec step cost 1.6-1.9 plain steps
(docs/benchmarks.md, "Speculative decoding: what 2x needs") while its device
work is about one decode step; this says where the rest goes. One fresh
process per mode (`plain`: no drafts, async scheduling; `spec_sync`: n-gram
k=4, synchronous; `spec_async`: n-gram k=4 with async scheduling), the bundled
model (real text: n-gram drafts need it) on benchmark_spec_decode.py's third
prompt (code quoted back), greedy, `ignore_eos`. Per mode:

  step_ms_median, tokens_per_step   one 256-token request, unprofiled
  phases_us                         inclusive host microseconds per step of the
                                    step's parts (perf_counter around each
                                    method for 40 steps; nested parts overlap)
  gpu_busy_ms_per_step              the union of the kernels' and copies'
                                    intervals under torch.profiler (80 tokens)
  gpu_busy_over_step                1.0: the device never waits for the host
  kernels, host_calls               the top entries per step
  host_functions                    cProfile's top functions by own time, 30 steps

    python benchmarks/benchmark_spec_profile.py --model /tmp/smollm2.gguf \\
        --out benchmarks/results/spec_profile.json

`--trace-dir D` also writes each mode's Chrome trace. Runs on the CPU too
(no profiler part there), for a check of the script, not of the figures.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark_decode_profile import _busy_us
from benchmark_spec_decode import MESSAGES
from common import emit

MODES = ("plain", "spec_sync", "spec_async")
PHASES = (("engine_core", "step"), ("engine_core", "_execute"), ("scheduler", "schedule"),
          ("scheduler", "update_from_output"), ("output_processor", "process_outputs"),
          ("runner", "_update_states"), ("runner", "_prepare_inputs"), ("runner", "_forward"),
          ("runner", "_sample"), ("async_spec", "prepare"), ("async_spec", "verify"),
          ("async_spec", "output"), ("spec_decoder", "verify_step"),
          ("spec_decoder", "propose"))


def _owners(engine) -> dict:
    core = engine.engine_core  # in-process: the uni executor
    runner = core.worker.model_runner
    return {"engine_core": core, "scheduler": core.scheduler,
            "output_processor": engine.output_processor, "runner": runner,
            "async_spec": runner.async_spec, "spec_decoder": runner.spec_decoder}


def _time_phases(engine, steps: int) -> dict[str, float]:
    """Inclusive host microseconds per step of each of PHASES over `steps` steps."""
    totals: dict[str, float] = collections.defaultdict(float)
    wrapped = []
    for name, owner in _owners(engine).items():
        for owner_name, attr in PHASES:
            if owner_name != name or owner is None:
                continue
            original = getattr(owner, attr)

            def timed(*args, _original=original, _label=f"{name}.{attr}", **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    totals[_label] += time.perf_counter() - t0

            setattr(owner, attr, timed)
            wrapped.append((owner, attr))
    try:
        for _ in range(steps):
            engine.step()
    finally:
        for owner, attr in wrapped:
            delattr(owner, attr)  # the instance attribute shadowed the class's method
    return {k: round(1e6 * v / steps, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _generate(engine, request_id: str, prompt: str, params) -> tuple[list[float], int]:
    """Step one request to its end: each step's wall seconds, the tokens it produced."""
    engine.add_request(request_id, prompt, params)
    times, tokens = [], 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            tokens = len(out.outputs[0].token_ids)
        times.append(time.perf_counter() - t0)
    return times, tokens


def run_mode(model: str | None, mode: str, trace_dir: str | None) -> dict:
    import torch

    from vllm import LLM, SamplingParams

    spec = None if mode == "plain" else {"method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    llm = LLM(model, max_model_len=2048, max_num_seqs=8, speculative_config=spec,
              async_scheduling=mode != "spec_sync")
    engine = llm.llm_engine
    prompts = [llm.render_chat([{"role": "user", "content": m}]) for m in MESSAGES]
    for prompt in prompts:  # compiles at these lengths are not what is measured
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    prompt = prompts[2]
    times, tokens = _generate(engine, "timed", prompt, SamplingParams(
        temperature=0.0, max_tokens=256, ignore_eos=True))
    result = {"mode": mode, "steps": len(times), "tokens": tokens,
              "tokens_per_step": tokens / len(times),
              "step_ms_median": 1e3 * statistics.median(times),
              "ms_per_token": 1e3 * sum(times) / tokens,
              "async_scheduling": engine.vllm_config.scheduler_config.async_scheduling}
    # Long enough that the request outlives the timed and the cProfile'd steps.
    engine.add_request("phases", prompt, SamplingParams(temperature=0.0, max_tokens=1200,
                                                        ignore_eos=True))
    engine.step()
    engine.step()
    result["phases_us"] = _time_phases(engine, 40)
    host = cProfile.Profile()
    host.enable()
    for _ in range(30):
        engine.step()
    host.disable()
    stats = pstats.Stats(host).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    result["host_functions"] = [
        {"function": f"{Path(f).name}:{line}({name})", "self_us_per_step": round(1e6 * tt / 30, 1),
         "cum_us_per_step": round(1e6 * ct / 30, 1), "calls_per_step": round(nc / 30, 2)}
        for (f, line, name), (_, nc, tt, ct, _) in sorted(stats.items(),
                                                           key=lambda kv: -kv[1][2])[:25]]
    while engine.has_unfinished_requests():
        engine.step()
    if torch.cuda.is_available():
        result.update(_device_profile(engine, prompt, mode, trace_dir))
    engine.shutdown()
    return result


def _device_profile(engine, prompt: str, mode: str, trace_dir: str | None) -> dict:
    """An 80-token request under torch.profiler (CUPTI sees the kernels inside graph
    replays): device busy per step, kernels per step, the top kernels and host calls."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm import SamplingParams

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        times, tokens = _generate(engine, "profiled", prompt, SamplingParams(
            temperature=0.0, max_tokens=80, ignore_eos=True))
        torch.cuda.synchronize()
    n = len(times)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = _busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / n / 1e3
    by_name = collections.defaultdict(list)
    for e in kernels:
        by_name[e.name[:90]].append(e.time_range.end - e.time_range.start)
    calls = sorted((r for r in prof.key_averages() if r.device_type == DeviceType.CPU),
                   key=lambda r: -r.self_cpu_time_total)[:20]
    out = {
        "profiled_steps": n, "profiled_ms_per_step": 1e3 * sum(times) / n,
        "gpu_busy_ms_per_step": busy,
        "gpu_busy_over_step": busy / (1e3 * sum(times) / n),
        "kernels_per_step": len(kernels) / n,
        "kernels": [{"name": k, "us_per_step": round(sum(d) / n, 1),
                     "calls_per_step": round(len(d) / n, 2)}
                    for k, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]],
        "host_calls": [{"name": r.key[:80], "self_us_per_step": round(
            r.self_cpu_time_total / n, 1), "calls_per_step": round(r.count / n, 2)}
            for r in calls],
    }
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace_dir) / f"spec_step_{mode}.json"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF / HF dir (default: the bundled one)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="plain: no drafts (async); spec_sync / spec_async: n-gram k=4 "
                             "with async scheduling off / on")
    parser.add_argument("--trace-dir", default=None, help="also write Chrome traces here")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.model, args.child, args.trace_dir)))
        return
    report: dict = {"model": args.model or "bundled SmolLM2-135M-Instruct", "modes": {}}
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", mode]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--trace-dir", args.trace_dir] if args.trace_dir else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        report["modes"][mode] = (json.loads(lines[-1][len("RESULT "):]) if lines else
                                 {"crashed": True, "returncode": proc.returncode,
                                  "stderr_tail": proc.stderr[-3000:]})
    plain = report["modes"].get("plain", {})
    if "step_ms_median" in plain:
        report["step_over_plain"] = {m: r["step_ms_median"] / plain["step_ms_median"]
                                     for m, r in report["modes"].items()
                                     if "step_ms_median" in r}
    emit(report, args.out)


if __name__ == "__main__":
    main()
