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
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

_WORDS = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
    "place", "case", "week", "company", "system", "program", "question", "work", "government",
    "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story",
    "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
    "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour",
    "game", "line", "end", "member", "law", "car", "city",
]


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_prompts(n: int, input_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_words)) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int, ignore_eos: bool) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.e2e_s = time.perf_counter() - start
        result.ok = last is not None
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


def _summary_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99))}


async def run_level(base_url: str, model: str, concurrency: int, prompts: list[str],
                    max_tokens: int, ignore_eos: bool, headers: dict[str, str]) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits,
                                 headers=headers) as client:

        async def bounded(prompt: str) -> RequestResult:
            async with semaphore:
                return await one_request(client, url, model, prompt, max_tokens, ignore_eos)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "ttft_ms": _summary_ms([r.ttft_s for r in ok]),
        "itl_ms": _summary_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _summary_ms([r.e2e_s for r in ok]),
    }


def wait_for_health(base_url: str, timeout: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the launched server exited with {proc.returncode}")
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} did not become healthy within {timeout:.0f} s")


def resolve_model(base_url: str, headers: dict[str, str]) -> str:
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


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
