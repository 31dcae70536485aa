"""The quick start on the CPU, before and after: a default `vllm serve`, its idle RSS and tokens/s.

Each source tree (a checkout of the fork; `--before` e.g. a `git worktree` of an older
commit) serves in turn, alternating, `--reps` times: `python -m vllm.entrypoints.cli.main
serve` of the bundled model with no engine flags (the quick start's `make serve`),
PYTHONPATH set to the tree. For each server:

    idle RSS   the sum of RSS over its process tree (API server, engine core, resource
               tracker) 2 s after /health answers (shared library pages count once per
               process: the sum errs high)
    tokens/s   `--requests` chat requests of the quick start ("What is the capital of
               France?", greedy, `--max-tokens` tokens each, ignore_eos) sent at once
               after one warm-up request: completion tokens / wall seconds
    cores      CPU seconds of the server's processes over the timed requests / wall
               seconds (above 1: more than one core computed)
    threads    the server's "CPU threads:" start-up line

and the machine's 1-minute load average before each run (the engine shares the
machine; compare runs at similar loads). Prints JSON {"before": {...}, "after": {...},
"speedup": after / before median tokens/s, "idle_rss_ratio": after / before median RSS}.

Example (main at a857b07 against this tree, on a quiet 2-core machine):
    git worktree add --detach /tmp/before a857b07
    python benchmarks/benchmark_cpu_serve.py --before /tmp/before --reps 2 \\
        --out benchmarks/results/cpu_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil
from common import ROOT, ServeProcess, emit

from vllm.benchmarks.utils import positive_int

_QUESTION = "What is the capital of France?"


class _Server(ServeProcess):
    """`vllm serve` (defaults) from one source tree, ready on return, until `close()`."""

    def __init__(self, tree: Path, extra_env: dict[str, str], timeout_s: float = 600) -> None:
        super().__init__(["--uvicorn-log-level", "warning"], cwd=tree,
                         env={"PYTHONPATH": str(tree), **extra_env})
        self.wait_ready(timeout_s)

    def _tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def tree_rss(self) -> int:
        return sum(p.memory_info().rss for p in self._tree())

    def tree_cpu_seconds(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self._tree())


async def _chat(client: httpx.AsyncClient, url: str, max_tokens: int) -> int:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": _QUESTION}]}
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


async def _burst(url: str, requests: int, max_tokens: int) -> float:
    """Output tokens/s of `requests` chats sent at once (after one warm-up chat)."""
    async with httpx.AsyncClient(timeout=600) as client:
        await _chat(client, url, 4)
        start = time.perf_counter()
        tokens = await asyncio.gather(*(_chat(client, url, max_tokens) for _ in range(requests)))
        return sum(tokens) / (time.perf_counter() - start)


def _run(tree: Path, extra_env: dict[str, str], args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    with _Server(tree, extra_env) as server:
        time.sleep(2.0)
        rss = server.tree_rss()
        cpu, start = server.tree_cpu_seconds(), time.perf_counter()
        tok_s = asyncio.run(_burst(server.url, args.requests, args.max_tokens))
        cores = (server.tree_cpu_seconds() - cpu) / (time.perf_counter() - start)
        threads = next((line.split("CPU threads:", 1)[1].strip()
                        for line in server.log().splitlines() if "CPU threads:" in line), None)
    return {"load_1min": load, "idle_rss_bytes": rss, "tok_s": tok_s,
            "server_cores_busy": cores, "threads": threads}


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True,
                   help="Source tree of the fork to compare against (e.g. a git worktree).")
    p.add_argument("--after", type=Path, default=ROOT,
                   help="Source tree measured as 'after' (default: this checkout).")
    p.add_argument("--before-env", type=_env_pair, action="append", default=[],
                   metavar="NAME=VALUE", help="An environment variable of the 'before' "
                   "servers (repeatable), e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=1 with --before "
                   "this tree: a setting against the default.")
    p.add_argument("--after-env", type=_env_pair, action="append", default=[],
                   metavar="NAME=VALUE", help="The same for the 'after' servers.")
    p.add_argument("--reps", type=positive_int, default=2,
                   help="Servers per tree, alternating (default: %(default)s).")
    p.add_argument("--requests", type=positive_int, default=16,
                   help="Chat requests sent at once per server (default: %(default)s).")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="Output tokens of each request (default: %(default)s).")
    p.add_argument("--out", type=Path, default=None, help="Also write the JSON to this file.")
    args = p.parse_args(argv)
    for tree in (args.before, args.after):
        if not (tree / "vllm" / "__init__.py").is_file():
            p.error(f"{tree} is not a source tree of the fork (no vllm/__init__.py)")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.reps):
        runs["before"].append(_run(args.before.resolve(), dict(args.before_env), args))
        runs["after"].append(_run(args.after.resolve(), dict(args.after_env), args))
    result: dict = {"config": {k: str(v) for k, v in vars(args).items() if k != "out"},
                    "cpus_allowed": len(os.sched_getaffinity(0))}
    for name, items in runs.items():
        result[name] = {"runs": items,
                        "median_tok_s": statistics.median(r["tok_s"] for r in items),
                        "median_idle_rss_gb": statistics.median(
                            r["idle_rss_bytes"] for r in items) / 1e9}
    result["speedup"] = result["after"]["median_tok_s"] / result["before"]["median_tok_s"]
    result["idle_rss_ratio"] = (result["after"]["median_idle_rss_gb"]
                                / result["before"]["median_idle_rss_gb"])
    emit(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
