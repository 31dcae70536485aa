"""`vllm bench latency`: end-to-end latency of one batch, offline, as vLLM prints it.

    vllm bench latency --model MODEL --batch-size 8 --input-len 32 --output-len 128 \
        --num-iters-warmup 10 --num-iters 30 --output-json latency.json

Each iteration generates `--batch-size` prompts of `--input-len` random tokens
(fresh tokens every iteration, so prefix caching never shortens the prefill),
`--output-len` tokens each, greedy, EOS ignored. Prints "Avg latency" and the
10/25/50/75/90/99th percentiles (seconds), plus this fork's TTFT and decode
figures (`vllm.benchmarks.timing`). As in vLLM, one progress bar counts the
"Warmup iterations", a second the "Profiling iterations" (timed). Engine flags
are `vllm serve`'s; max_num_seqs, left unset, is the engine's default unless
`--batch-size` is larger (then the batch, so it runs as one).
"""

from __future__ import annotations

import argparse

import numpy as np

from vllm.benchmarks.utils import (
    add_length_args,
    add_run_args,
    non_negative_int,
    positive_int,
    run_offline,
)

PERCENTILES = [10, 25, 50, 75, 90, 99]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_length_args(parser, input_len=32)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="Prompts per batch.")
    parser.add_argument("--num-iters-warmup", type=non_negative_int, default=10,
                        help="Untimed iterations first.")
    parser.add_argument("--num-iters", type=positive_int, default=30, help="Timed iterations.")
    add_run_args(parser)


def main(args: argparse.Namespace) -> int:
    """Build the engine from the flags and run `run`'s iterations on it (`run_offline`: the
    output path is checked first; its errors are listed there)."""
    return run_offline(args, run, max_num_seqs_at_least=args.batch_size)


def run(llm, args: argparse.Namespace) -> dict:
    """The iterations on `llm` (an offline `LLM`); prints vLLM's lines, returns its JSON."""
    from tqdm.auto import tqdm

    from vllm.benchmarks.timing import random_token_prompts, time_batch
    from vllm.sampling_params import SamplingParams

    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    def one_batch(seed: int):  # fresh prompts every iteration: no prefix-cache hits
        prompts = random_token_prompts(args.batch_size, args.input_len, vocab, seed=seed)
        return time_batch(llm, prompts, params)

    warmup = args.num_iters_warmup
    for i in tqdm(range(warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        one_batch(i)
    timed = []
    for i in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm):
        timed.append(one_batch(warmup + i))
    latencies = np.array([r.total_s for r in timed])
    percentiles = np.percentile(latencies, PERCENTILES)
    print(f"Avg latency: {latencies.mean()} seconds")
    for pct, value in zip(PERCENTILES, percentiles, strict=True):
        print(f"{pct}% percentile latency: {value} seconds")
    ttft = float(np.mean([r.ttft_s for r in timed]))
    decode = float(np.median([r.decode_step_ms_median for r in timed]))
    print(f"Avg TTFT: {ttft} seconds; median decode step: {decode} ms")
    return {
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, percentiles, strict=True)},
        "avg_ttft": ttft,
        "median_decode_step_ms": decode,
        "iterations": [r.to_dict() for r in timed],
    }
