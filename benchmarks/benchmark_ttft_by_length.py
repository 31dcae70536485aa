"""TTFT of a fresh engine's first request at each prompt length, against the same length again.

One engine per shape, started fresh (start-up warm-up included, nothing served
before). For each of `--num-lengths` prompt lengths from 1 to max_model_len - 1
(geometric, so short lengths are dense; odd and even, multiples of 16 and not),
in increasing order: one request of that length (random tokens, one output
token, greedy), then a second request of the same length with other random
tokens (prefix caching finds nothing in either). The ratio first / second is
what a user pays the first time a length class is seen: a Triton compilation
on the request path shows up as a ratio far above 1.

    python benchmarks/benchmark_ttft_by_length.py --shapes smollm2 llama3_8b \
        --max-model-len 4096 --out benchmarks/results/ttft_by_length.json

Target (issue 10): every ratio <= 2 (before: up to 65x on the H200).
"""

from __future__ import annotations

import argparse

from common import SHAPES, emit, model_dir_for

from vllm.benchmarks.utils import positive_int


def prompt_lengths(max_model_len: int, num: int) -> list[int]:
    """`num` distinct lengths in [1, max_model_len - 1], about geometric, ascending."""
    top = max_model_len - 1
    lengths = {1, top}
    for i in range(1, num - 1):
        lengths.add(max(1, min(top, round(top ** (i / (num - 1))))))
    k = 2
    while len(lengths) < min(num, top):  # fill small gaps when rounding merged some
        lengths.add(k)
        k += 1
    return sorted(lengths)


def bench_shape(model_dir: str, max_model_len: int, lengths: list[int]) -> dict:
    import gc

    import torch

    from vllm import LLM, SamplingParams
    from vllm.benchmarks.timing import random_token_prompts, time_batch

    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for index, length in enumerate(lengths):
        first = time_batch(llm, random_token_prompts(1, length, vocab, 2 * index), params)
        again = time_batch(llm, random_token_prompts(1, length, vocab, 2 * index + 1), params)
        rows.append({
            "prompt_len": length,
            "first_ttft_ms": 1e3 * first.ttft_s,
            "again_ttft_ms": 1e3 * again.ttft_s,
            "ratio": first.ttft_s / again.ttft_s,
            "prefix_cache_hit_tokens": first.prefix_cache_hit_tokens
            + again.prefix_cache_hit_tokens,
        })
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    worst = max(rows, key=lambda r: r["ratio"])
    return {"lengths": rows, "max_ratio": worst["ratio"],
            "max_ratio_prompt_len": worst["prompt_len"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama3_8b"],
                        choices=list(SHAPES), help="model shapes (random weights, bf16)")
    parser.add_argument("--max-model-len", type=positive_int, default=4096,
                        help="the engine's max_model_len; prompts run up to one token less")
    parser.add_argument("--num-lengths", type=positive_int, default=20,
                        help="prompt lengths, about geometric from 1 to max_model_len - 1")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU (code path only; the target is for the GPU)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("benchmark_ttft_by_length needs a CUDA GPU (or --allow-cpu)")
    lengths = prompt_lengths(args.max_model_len, args.num_lengths)
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "max_model_len": args.max_model_len,
        "target_max_ratio": 2.0,
        "shapes": {shape: bench_shape(model_dir_for(shape), args.max_model_len, lengths)
                   for shape in args.shapes},
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
