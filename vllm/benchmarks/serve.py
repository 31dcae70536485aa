"""`vllm bench serve`: load a running OpenAI-compatible server, print vLLM's summary.

    vllm serve MODEL &
    vllm bench serve --num-prompts 200 --max-concurrency 32 --random-input-len 128 \
        --random-output-len 128 --output-json serve.json

Synthetic prompts of `--random-input-len` random words (the server counts the
tokens: "Total input tokens" is its figure), `--random-output-len` tokens each
(EOS ignored unless --no-ignore-eos), streamed through /v1/completions with at
most `--max-concurrency` in flight at `--request-rate` requests/s (inf: all at
once). Exit status 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from vllm.benchmarks.utils import positive_float, positive_int, write_json


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="Server root URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default="127.0.0.1", help="Server host.")
    parser.add_argument("--port", type=positive_int, default=8000, help="Server port.")
    parser.add_argument("--model", default=None, help="Model name (default: the first served).")
    parser.add_argument("--api-key", default=None, help="Bearer key, if the server needs one.")
    parser.add_argument("--num-prompts", type=positive_int, default=1000,
                        help="Requests to send.")
    parser.add_argument("--random-input-len", type=positive_int, default=1024,
                        help="Words per synthetic prompt.")
    parser.add_argument("--random-output-len", type=positive_int, default=128,
                        help="max_tokens of each request.")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="Most requests in flight (default: all of them).")
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="Requests per second, Poisson arrivals (default inf: all at once).")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="Let requests stop at EOS (default: exactly the output length).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrivals.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    parser.add_argument("--output-json", default=None, help="Also write the results here.")


def print_summary(level: dict) -> None:
    """vLLM's `vllm bench serve` result block."""
    def line(name: str, value, fmt: str = ".2f") -> None:
        print(f"{name:<40} {value:<10{fmt}}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", level["num_requests"] - level["failed"], "")
    line("Failed requests:", level["failed"], "")
    line("Benchmark duration (s):", level["duration_s"])
    line("Total input tokens:", level["total_input_tokens"], "")
    line("Total generated tokens:", level["total_output_tokens"], "")
    line("Request throughput (req/s):", level["request_throughput"])
    line("Output token throughput (tok/s):", level["output_throughput"])
    total = (level["total_input_tokens"] + level["total_output_tokens"]) / level["duration_s"]
    line("Total Token throughput (tok/s):", total)
    for title, key, name in (("Time to First Token", "ttft_ms", "TTFT"),
                             ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
                             ("Inter-token Latency", "itl_ms", "ITL")):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        line(f"Mean {name} (ms):", level[key]["mean"])
        line(f"Median {name} (ms):", level[key]["p50"])
        line(f"P99 {name} (ms):", level[key]["p99"])
    print("=" * 50)


def main(args: argparse.Namespace) -> int:
    import httpx
    from tqdm.auto import tqdm

    from vllm.benchmarks.serve_client import make_prompts, resolve_model, run_level

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or resolve_model(base_url, headers)
    except (httpx.HTTPError, KeyError, IndexError, json.JSONDecodeError) as e:
        print(f"vllm bench serve: error: no server answers at {base_url} ({e})", file=sys.stderr)
        return 2
    prompts = make_prompts(args.num_prompts, args.random_input_len, args.seed)
    concurrency = args.max_concurrency or args.num_prompts
    with tqdm(total=len(prompts), disable=args.disable_tqdm, desc="Requests") as bar:
        level = asyncio.run(run_level(base_url, model, concurrency, prompts,
                                      args.random_output_len, not args.no_ignore_eos, headers,
                                      request_rate=args.request_rate, progress=bar,
                                      seed=args.seed))
    print_summary(level)
    if args.output_json:
        write_json(args.output_json, {"model": model, "base_url": base_url,
                                      "max_concurrency": args.max_concurrency,
                                      "request_rate": (args.request_rate if args.request_rate
                                                       < float("inf") else "inf"), **level})
    return 0 if level["failed"] == 0 else 1
