"""`vllm bench throughput`: offline throughput of many random prompts, as vLLM prints it.

    vllm bench throughput --model MODEL --num-prompts 1000 --input-len 128 \
        --output-len 128 --output-json throughput.json

`--num-prompts` prompts of `--input-len` random tokens (the random dataset),
`--output-len` tokens each, greedy, EOS ignored, all handed to `LLM.generate`
at once (progress bar: prompts done). Prints vLLM's "Throughput: ... requests/s,
... total tokens/s, ... output tokens/s" and the token totals. Engine flags are
`vllm serve`'s.
"""

from __future__ import annotations

import argparse
import time

from vllm.benchmarks.utils import add_length_args, add_run_args, positive_int, run_offline


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_length_args(parser, input_len=128)
    parser.add_argument("--num-prompts", type=positive_int, default=1000, help="Prompts.")
    add_run_args(parser)


def main(args: argparse.Namespace) -> int:
    """Build the engine from the flags and run `run`'s prompts on it (`run_offline`: the
    output path is checked first; its errors are listed there)."""
    return run_offline(args, run)


def run(llm, args: argparse.Namespace) -> dict:
    """All prompts through `llm` (an offline `LLM`); prints vLLM's lines, returns its JSON."""
    from vllm.benchmarks.timing import random_token_prompts
    from vllm.sampling_params import SamplingParams

    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    prompts = random_token_prompts(args.num_prompts, args.input_len, vocab,
                                   args.seed or 0)  # the engine's --seed, as vLLM
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total "
          f"tokens/s, {output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_num_prompt_tokens": prompt_tokens,
        "total_num_output_tokens": output_tokens,
    }
