"""Short-prompt TTFT against the decode step, with mixed-batch CUDA graphs and without.

Issue 50: one 7-token request (`LLM.generate`, max_tokens 1) took 15 ms on the
SmolLM2 shape against a 0.63 ms decode step (H100, 2026-12-06): a step with a
prefill chunk ran eagerly, ~200 kernels launched from Python. For each shape
(random weights, bf16) two engines in turn, in one run: the default, whose
steps with prefill chunks of <= 256 tokens replay mixed-batch graphs
(vllm/v1/worker/mixed_graphs.py), and the peer `cudagraph_mode
"FULL_DECODE_ONLY"` (those steps eager, as before). On each:

  decode_step_ms   batch 1, median engine step of a 64-token decode (time_batch)
  per prompt length (1, 7, 16, 32 tokens by default), --reps fresh random prompts:
    ttft_ms        median time from add_request to the first token (time_batch's loop)
    generate_ms    median `LLM.generate([prompt], max_tokens=1)`, no progress bar
    ratio          ttft_ms / decode_step_ms (targets: <= 3 SmolLM2, <= 1.5 8B)
    phases_ms      one more request, each phase timed with a device sync at its end
                   (so a phase owns the device work it launched; the sum runs slower
                   than the unsynchronised request): add_request (input processing,
                   scheduler admission), schedule, update_states, prepare_inputs
                   (host layout, H2D copies), forward (graph replay or eager
                   layers), sample (lm_head, sampler), runner_other (the rest of
                   execute_model: outputs, drafts), wait_output (async scheduling:
                   the sampled ids' copy to the host), update_from_output (stop
                   checks, block frees), process_outputs (detokenize,
                   RequestOutput), other; `steps` counts engine schedules (with
                   async scheduling a one-token request also launches one decode
                   step before its first token comes back).

    python benchmarks/benchmark_short_prompt_ttft.py --shapes smollm2 llama3_8b \
        --out benchmarks/results/short_prompt_ttft.json

`speedup` per length is the peer's ttft_ms / the default's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict

from common import SHAPES, emit, model_dir_for

from vllm.benchmarks.utils import positive_int

TARGET_RATIO = {"smollm2": 3.0, "llama3_8b": 1.5}
# (module, class, method, phase): the leaves of a request's path, timed by PhaseTimer.
PHASES = (
    ("vllm.v1.engine.llm_engine", "LLMEngine", "add_request", "add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", "update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_forward", "forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample", "sample"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "execute_model"),
    ("vllm.v1.worker.async_output", "AsyncRunnerOutput", "get_output", "wait_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs",
     "process_outputs"),
)
RUNNER_LEAVES = ("update_states", "prepare_inputs", "forward", "sample")


class PhaseTimer:
    """Wall milliseconds per phase of `PHASES`, each call ended by a device sync.

    `install()` wraps the methods on their classes (the uni executor runs the
    worker in this process); `uninstall()` puts the originals back.
    """

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._originals: list[tuple[type, str, object]] = []

    def install(self) -> None:
        import importlib

        import torch

        for module, cls_name, method, phase in PHASES:
            cls = getattr(importlib.import_module(module), cls_name)
            original = cls.__dict__[method]
            self._originals.append((cls, method, original))

            def timed(*args, _f=original, _phase=phase, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    torch.cuda.synchronize()
                    self.ms[_phase] += 1e3 * (time.perf_counter() - t0)
                    self.calls[_phase] += 1

            setattr(cls, method, timed)

    def uninstall(self) -> None:
        for cls, method, original in reversed(self._originals):
            setattr(cls, method, original)
        self._originals.clear()

    def report(self, total_ms: float) -> dict:
        """Phases in ms (execute_model split into its leaves and runner_other), other, steps."""
        ms = dict(self.ms)
        execute = ms.pop("execute_model", 0.0)
        ms["runner_other"] = execute - sum(ms.get(p, 0.0) for p in RUNNER_LEAVES)
        ms["other"] = total_ms - sum(ms.values())
        return {"total_ms": total_ms, "steps": self.calls["schedule"],
                "phases_ms": {k: round(v, 4) for k, v in ms.items()}}


def _breakdown(llm, prompt: dict, params) -> dict:
    timer = PhaseTimer()
    timer.install()
    try:
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        total = 1e3 * (time.perf_counter() - t0)
    finally:
        timer.uninstall()
    return timer.report(total)


def bench_engine(model_dir: str, lengths: list[int], reps: int, max_model_len: int,
                 max_num_seqs: int, mode: str) -> dict:
    """Decode step, TTFT per prompt length and one phase breakdown per length, on one engine."""
    import torch

    from vllm import LLM, SamplingParams
    from vllm.benchmarks.timing import random_token_prompts, time_batch

    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, compilation_config={"cudagraph_mode": mode})
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    runner = llm.llm_engine.engine_core.worker.model_runner
    decode = time_batch(llm, random_token_prompts(1, 16, vocab, 1),
                        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    step_ms = decode.decode_step_ms_median
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows, seed = {}, 100
    for length in lengths:
        ttft, generate = [], []
        for _ in range(reps):
            seed += 2
            ttft.append(1e3 * time_batch(llm, random_token_prompts(1, length, vocab, seed),
                                         one).ttft_s)
            prompt = random_token_prompts(1, length, vocab, seed + 1)
            t0 = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            generate.append(1e3 * (time.perf_counter() - t0))
        replays = runner.mixed.graphs.num_replays
        seed += 1
        breakdown = _breakdown(llm, random_token_prompts(1, length, vocab, seed)[0], one)
        rows[length] = {
            "ttft_ms": statistics.median(ttft), "generate_ms": statistics.median(generate),
            "ratio": statistics.median(ttft) / step_ms,
            "generate_ratio": statistics.median(generate) / step_ms,
            "mixed_graph_replays": runner.mixed.graphs.num_replays - replays, **breakdown,
        }
    result = {"cudagraph_mode": mode, "mixed_capture_sizes": runner.mixed.graphs.capture_sizes,
              "decode_step_ms": step_ms, "lengths": rows,
              "max_ratio": max(r["ratio"] for r in rows.values())}
    llm.llm_engine.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def bench_shape(shape: str, args: argparse.Namespace) -> dict:
    model_dir = model_dir_for(shape)
    run = {mode: bench_engine(model_dir, args.lengths, args.reps, args.max_model_len,
                              args.max_num_seqs, mode) for mode in ("FULL", "FULL_DECODE_ONLY")}
    ours, peer = run["FULL"], run["FULL_DECODE_ONLY"]
    target = TARGET_RATIO.get(shape)
    return {
        "mixed_graphs": ours, "eager_prefill": peer,
        "speedup": {n: peer["lengths"][n]["ttft_ms"] / ours["lengths"][n]["ttft_ms"]
                    for n in args.lengths},
        "target_ratio": target,
        "met": None if target is None else ours["max_ratio"] <= target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama3_8b"],
                        choices=list(SHAPES), help="model shapes (random weights, bf16)")
    parser.add_argument("--lengths", nargs="+", type=positive_int, default=[1, 7, 16, 32],
                        help="prompt lengths in tokens")
    parser.add_argument("--reps", type=positive_int, default=10,
                        help="requests per length and measure (medians)")
    parser.add_argument("--max-model-len", type=positive_int, default=1024,
                        help="the engines' max_model_len")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256,
                        help="the engines' max_num_seqs (256: the default, as in the issue)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmark_short_prompt_ttft needs a CUDA GPU (graphs are CUDA's)")
    report = {"device": torch.cuda.get_device_name(),
              "shapes": {shape: bench_shape(shape, args) for shape in args.shapes}}
    emit(report, args.out)


if __name__ == "__main__":
    main()
