"""Serving benchmark: a concurrency sweep over the OpenAI API of a running `vllm serve`.

For each concurrency level C, `--num-prompts` requests (at least C) are sent
with at most C in flight, all streaming, so every request measures its time
to first token (TTFT), the gaps between its content chunks (inter-token
latency, ITL) and its end-to-end latency; output tokens come from the usage
chunk. Prints (and with --out writes) JSON:

    {"config": {...}, "results": [{"concurrency": C, "request_throughput": req/s,
      "output_throughput": tok/s, "ttft_ms": {"mean", "p50", "p99"},
      "itl_ms": {...}, "e2e_ms": {...}, "num_requests", "failed", "duration_s"}, ...]}

Examples:
    vllm serve &  python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000
    python benchmarks/benchmark_serving.py --launch "vllm serve --port 8000" --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vllm

from vllm.benchmarks.serve_client import (
    make_prompts,
    resolve_model,
    run_level,
    wait_for_health,
)


async def sweep(args: argparse.Namespace, model: str, headers: dict[str, str]) -> list[dict]:
    # Warm-up: the first request pays one-time costs (allocator, caches).
    await run_level(args.base_url, model, 1, make_prompts(1, args.input_words, args.seed + 1),
                    8, True, headers)
    results = []
    for concurrency in args.concurrency:
        n = max(args.num_prompts, concurrency)
        prompts = make_prompts(n, args.input_words, args.seed + concurrency)
        level = await run_level(args.base_url, model, concurrency, prompts, args.output_tokens,
                                not args.no_ignore_eos, headers)
        print(f"concurrency {concurrency}: {level['request_throughput']:.2f} req/s, "
              f"{level['output_throughput']:.1f} tok/s, TTFT p50 {level['ttft_ms']['p50']:.1f} "
              f"ms, ITL p50 {level['itl_ms']['p50']:.1f} ms, failed {level['failed']}",
              file=sys.stderr)
        results.append(level)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root URL.")
    p.add_argument("--model", default=None, help="Model name (default: the first served).")
    p.add_argument("--api-key", default=None, help="Bearer key, if the server needs one.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128],
                   help="Concurrency levels of the sweep.")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="Requests per level (at least the concurrency).")
    p.add_argument("--input-words", type=int, default=128, help="Words per synthetic prompt.")
    p.add_argument("--output-tokens", type=int, default=128, help="max_tokens per request.")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="Let requests stop at EOS (default: exactly --output-tokens each).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the synthetic prompts.")
    p.add_argument("--launch", default=None,
                   help='Start this server command first, e.g. "vllm serve --port 8000", and '
                        "stop it (SIGTERM) at the end.")
    p.add_argument("--launch-timeout", type=float, default=900, help="Seconds to wait for it.")
    p.add_argument("--out", default=None, help="Also write the JSON here.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc = subprocess.Popen(shlex.split(args.launch)) if args.launch else None
    try:
        wait_for_health(args.base_url, args.launch_timeout if proc else 30, proc)
        model = args.model or resolve_model(args.base_url, headers)
        results = asyncio.run(sweep(args, model, headers))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    report = {
        "config": {"base_url": args.base_url, "model": model, "input_words": args.input_words,
                   "output_tokens": args.output_tokens, "num_prompts": args.num_prompts,
                   "ignore_eos": not args.no_ignore_eos, "launch": args.launch},
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
