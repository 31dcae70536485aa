"""Engine steps and host CPU time per step of `LLM.generate` (CPU or GPU).

A batch of short prompts decodes `--output-len` tokens; the ideal is one
engine step per output token (the prompts start together, then decode
together). Reports the step count against that ideal, and the process CPU
time (all threads) and wall time per step, best of `--repeats` runs. The
default shape is a tiny 2-layer Llama (random weights), so the figure is the
engine's own per-step cost, not the model's; `--shape smollm2|llama3_8b` uses
the benchmark shapes.

    python benchmarks/benchmark_engine_steps.py --batch-sizes 1 32 \
        --out benchmarks/results/steps.json

Found the batch-32 regression of issue 10: 95 steps for 64 output tokens.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from common import SHAPES, emit, model_dir_for

from vllm.benchmarks.utils import positive_int


def _model_dir(shape: str) -> str:
    if shape != "tiny":
        return model_dir_for(shape)
    from tests.model_dirs import llama_config, make_model_dir

    directory = Path(tempfile.gettempdir()) / "vllm-bench-tiny-v1"
    if not (directory / "config.json").exists():
        make_model_dir(directory, llama_config(), weights=False)
    return str(directory)


def bench(llm, batch: int, input_len: int, output_len: int, repeats: int) -> dict:
    from vllm import SamplingParams

    scheduler = llm.llm_engine.engine_core.scheduler
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    steps = [0]
    schedule = scheduler.schedule

    def counting_schedule():
        steps[0] += 1
        return schedule()

    scheduler.schedule = counting_schedule
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(input_len)]}
                   for _ in range(batch)]  # fresh tokens: no prefix-cache hits
        steps[0] = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append({"steps": steps[0], "cpu_s": time.process_time() - cpu0,
                     "wall_s": time.perf_counter() - wall0})
    best = min(runs[1:] or runs, key=lambda run: run["cpu_s"])
    scheduler.schedule = schedule
    return {
        "steps": best["steps"],
        "ideal_steps": output_len,
        "steps_ratio_to_ideal": best["steps"] / output_len,
        "cpu_ms_per_step": 1e3 * best["cpu_s"] / best["steps"],
        "wall_ms_per_step": 1e3 * best["wall_s"] / best["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES],
                        help="model shape, random weights (tiny: a 2-layer Llama)")
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 32],
                        help="prompts generated together, one measurement each")
    parser.add_argument("--input-len", type=positive_int, default=8, help="prompt tokens")
    parser.add_argument("--output-len", type=positive_int, default=64,
                        help="output tokens (the ideal: one engine step each)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="runs per batch size; the best is reported")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    from vllm import LLM

    llm = LLM(_model_dir(args.shape), load_format="dummy",
              max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(args.batch_sizes))
    report = {"shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
              "batches": {b: bench(llm, b, args.input_len, args.output_len, args.repeats)
                          for b in args.batch_sizes}}
    llm.llm_engine.shutdown()
    emit(report, args.out)


if __name__ == "__main__":
    main()
