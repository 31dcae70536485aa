"""Serving benchmark: a concurrency sweep over the OpenAI API of a running `vllm serve`.

For each concurrency level C, `--num-prompts` requests (at least C) are sent
with at most C in flight, all streaming, so every request measures its time
to first token (TTFT), its inter-token latencies (ITL, per token: a chunk of
k tokens counts k gaps of gap / k, `vllm/benchmarks/serve_client.py`) and its
end-to-end latency; output tokens come from the usage chunk.

The peer (`--engine-args`): the script starts `vllm serve ENGINE_ARGS` itself,
runs the sweep, stops the server, then runs the offline engine with the same
flags (`vllm bench throughput ENGINE_ARGS --max-num-seqs B`) on as many prompts
as the level sent, of the level's mean prompt length and the same output
length: the offline engine's output tok/s at the server's batch (B = at most C
running, or the server's smaller --max-num-seqs, the device's default when the
flags leave it unset). `vs_offline` = the server's output
tok/s / the offline engine's: 1.0 means the HTTP frontend costs nothing; below
it the event loop (detokenizing, building and writing chunks) holds the device
back. Prints (and with --out writes) JSON:

    {"config": {...}, "results": [{"concurrency": C, "request_throughput": req/s,
      "output_throughput": tok/s, "ttft_ms": {"mean", "p50", "p99"},
      "itl_ms": {...}, "e2e_ms": {...}, "tokens_per_chunk", "num_requests", "failed",
      "duration_s", "offline_output_throughput": tok/s, "vs_offline": ratio,
      "server_cpu_us_per_token", "server_cpu_share", "client_cpu_share"}, ...]}

The last two when the script started the server: the API server process's CPU
time (all its threads, not the engine core's process) per output token, and
over the level's duration (1.0: one core busy; near it the frontend is the
bottleneck). `client_cpu_share` is this script's own (one event loop parsing
every chunk): near 1.0 the client, not the server, sets the pace, and its
ITLs read bursts (chunks timed when its loop gets to them).

A server the script starts (`--launch`, `--engine-args`) writes to a log file whose
path goes to stderr; a start-up failure quotes its end. If something already listens
at --base-url the script stops first (exit 2): the new server could not bind, and the
levels would measure the old one. At the end it gets SIGTERM
(SIGKILL to its process group after 120 s).

Examples:
    vllm serve &  python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000
    python benchmarks/benchmark_serving.py --launch "vllm serve --port 8000" --out r.json
    python benchmarks/benchmark_serving.py --engine-args "--model DIR --load-format dummy" \
        --concurrency 32 128 --num-prompts 128 --output-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vllm

from benchmarks.common import ServeProcess
from vllm.benchmarks.serve_client import (
    make_prompts,
    resolve_model,
    run_level,
    wait_for_health,
)


def _cpu_s(server) -> float:
    """CPU seconds (user + system, all threads, not its children) the process has used."""
    times = server.cpu_times()
    return times.user + times.system


async def sweep(args: argparse.Namespace, model: str, headers: dict[str, str],
                server_pid: int | None = None) -> list[dict]:
    """The levels' figures; with `server_pid` (the API server's process, the engine core
    being its child) also the server's CPU per output token and its share of one core."""
    server = None
    if server_pid is not None:
        import psutil

        server = psutil.Process(server_pid)
    # Warm-up: the first request pays one-time costs (allocator, caches).
    await run_level(args.base_url, model, 1, make_prompts(1, args.input_words, args.seed + 1),
                    8, True, headers)
    results = []
    for concurrency in args.concurrency:
        n = max(args.num_prompts, concurrency)
        prompts = make_prompts(n, args.input_words, args.seed + concurrency)
        cpu_start = _cpu_s(server) if server is not None else 0.0
        level = await run_level(args.base_url, model, concurrency, prompts, args.output_tokens,
                                not args.no_ignore_eos, headers)
        if server is not None:
            cpu = _cpu_s(server) - cpu_start
            level["server_cpu_us_per_token"] = cpu / max(level["total_output_tokens"], 1) * 1e6
            level["server_cpu_share"] = cpu / level["duration_s"]
        print(f"concurrency {concurrency}: {level['request_throughput']:.2f} req/s, "
              f"{level['output_throughput']:.1f} tok/s, TTFT p50 {level['ttft_ms']['p50']:.1f} "
              f"ms, ITL p50 {level['itl_ms']['p50']:.2f} ms, "
              f"{level['tokens_per_chunk']:.2f} tokens a chunk, CPU share: server "
              f"{level.get('server_cpu_share', float('nan')):.2f}, client "
              f"{level['client_cpu_share']:.2f}, failed {level['failed']}",
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
    p.add_argument("--engine-args", default=None,
                   help='Engine flags, e.g. "--model DIR --load-format dummy": start '
                        '`vllm serve ENGINE_ARGS --port PORT` (the port of --base-url) and, '
                        "after the sweep, the offline peer with the same flags (see the "
                        "module doc). Excludes --launch.")
    p.add_argument("--launch-timeout", type=float, default=900, help="Seconds to wait for it.")
    p.add_argument("--out", default=None, help="Also write the JSON here.")
    return p.parse_args(argv)


_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
_MAX_NUM_SEQS = argparse.ArgumentParser(add_help=False)
_MAX_NUM_SEQS.add_argument("--max-num-seqs", type=int, default=None)


def server_batch(flags: list[str], concurrency: int) -> int:
    """Most requests the server started with `flags` runs at once at `concurrency`: the
    smaller of the two and its --max-num-seqs, the device's default when unset (64 on
    the CPU: a peer at 128 there ran twice the server's batch)."""
    from vllm.config.scheduler import default_limits
    from vllm.platforms import current_platform

    given, _ = _MAX_NUM_SEQS.parse_known_args(flags)
    limit = given.max_num_seqs or default_limits(current_platform.device_type)[0]
    return min(concurrency, limit)


def offline_peer(engine_args: str, concurrency: int, num_prompts: int, input_len: int,
                 output_tokens: int, seed: int) -> float:
    """Output tok/s of the offline engine (`vllm bench throughput` with `engine_args`) on
    `num_prompts` prompts of `input_len` random tokens, `output_tokens` each, at most
    `server_batch(engine_args, concurrency)` running: what the server could run."""
    flags = shlex.split(engine_args)
    batch = server_batch(flags, concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        # Timed whole, prefills included, as the server level's duration includes its
        # prompts'. (argparse: the last --max-num-seqs wins.)
        subprocess.run([*_CLI, "bench", "throughput", *flags, "--max-num-seqs", str(batch),
                        "--num-prompts", str(num_prompts), "--input-len", str(input_len),
                        "--output-len", str(output_tokens), "--seed", str(seed),
                        "--disable-tqdm", "--output-json", str(out)], check=True)
        return json.loads(out.read_text())["output_tokens_per_second"]


def _launch(command: list[str], args: argparse.Namespace) -> ServeProcess:
    """Start `command` (a server listening at --base-url), its output in a log file named
    on stderr; return once it answers /health."""
    fd, log_path = tempfile.mkstemp(prefix="benchmark-serving-server-", suffix=".log")
    os.close(fd)
    print(f"server log: {log_path}", file=sys.stderr)
    server = ServeProcess([], log_path=log_path, command=command, url=args.base_url,
                          cwd=os.getcwd())  # relative paths in the command stay valid
    server.wait_ready(args.launch_timeout)
    return server


def _answering(base_url: str) -> bool:
    """Whether something accepts TCP connections at `base_url`'s host and port."""
    url = urlsplit(base_url)
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=2).close()
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_args and args.launch:
        print("benchmark_serving.py: error: --engine-args and --launch exclude each other",
              file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    launch = shlex.split(args.launch) if args.launch else None
    if args.engine_args:
        port = args.base_url.rstrip("/").rsplit(":", 1)[-1]
        launch = [*_CLI, "serve", *shlex.split(args.engine_args), "--port", port]
    if launch and _answering(args.base_url):
        # The launched server could not bind, and the level would measure this one.
        print(f"benchmark_serving.py: error: something already listens at {args.base_url}; "
              "stop it or give --base-url another port", file=sys.stderr)
        return 2
    server = _launch(launch, args) if launch else None
    try:
        if server is None:
            wait_for_health(args.base_url, 30, None)
        model = args.model or resolve_model(args.base_url, headers)
        results = asyncio.run(sweep(args, model, headers, server.proc.pid if server else None))
    finally:
        if server is not None:
            server.stop(120)
    if args.engine_args:  # the server is gone: the device is the peer's alone
        for level in results:
            input_len = max(round(level["total_input_tokens"] / max(level["num_requests"], 1)),
                            1)
            peer = offline_peer(args.engine_args, level["concurrency"], level["num_requests"],
                                input_len, args.output_tokens, args.seed)
            level["offline_output_throughput"] = peer
            level["vs_offline"] = level["output_throughput"] / peer
            print(f"concurrency {level['concurrency']}: offline {peer:.1f} tok/s, server / "
                  f"offline {level['vs_offline']:.3f}", file=sys.stderr)
    report = {
        "config": {"base_url": args.base_url, "model": model, "input_words": args.input_words,
                   "output_tokens": args.output_tokens, "num_prompts": args.num_prompts,
                   "ignore_eos": not args.no_ignore_eos, "launch": args.launch,
                   "engine_args": args.engine_args},
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
