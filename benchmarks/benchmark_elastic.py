"""Two `vllm serve` engines on one device: elastic KV cache vs a static 0.45 / 0.45 split.

Question (issue #18): with bursts that alternate between two engines (one busy
while the other idles, then the reverse), does `--enable-elastic-kv-cache`
serve at least as many tokens, with a TTFT p99 no worse, than two engines that
split the device statically, with no OOM and no CUDA graph re-capture?

For each mode the two servers start one after the other on the same device
(random weights of `--shape`, `load_format=dummy`), then `--bursts` bursts of
`--burst-requests` streaming completions go alternately to engine A and B
(`--gap-s` apart). A sampler reads both servers' `/metrics` every
`--sample-s`: committed KV bytes and preemptions over time. Per mode:

    tokens served (output tokens of successful requests), duration, output
    throughput, TTFT p50/p99 (ms), preemptions, failed requests, OOMs (a server
    died or logged "out of memory"), CUDA graph captures per server (log lines
    "Captured ... CUDA graphs": 1 = never re-captured)

and `ratio` = elastic / static for throughput and TTFT p99. JSON to stdout
(and `--out`); the committed-bytes time series to `--csv` and, where
matplotlib is installed, a plot to `--png`.

    python benchmarks/benchmark_elastic.py --shape llama3_8b --out r.json \
        --csv r.csv --png docs/images/elastic_committed.png
    python benchmarks/benchmark_elastic.py --smoke      # CPU, bundled model, tiny
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))


from common import ROOT, SHAPES, emit, model_dir_for

from vllm.benchmarks.serve_client import make_prompts, resolve_model, run_level
from vllm.benchmarks.utils import positive_float, positive_int

_URL = re.compile(r"listening on (http://\S+)")
_METRIC = re.compile(r'^(vllm:[a-z_]+)\{[^}]*\} ([0-9.e+]+)$', re.M)


class Server:
    """One `vllm serve` subprocess on a free port, its log in a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: str) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the server
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
               "--host", "127.0.0.1", "--port", "0", "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env},
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = Path(self.log_path).read_text(errors="replace")
            match = _URL.search(text)
            if match:
                self.url = match.group(1)
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up:\n{text[-3000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start within {timeout} s")

    def metrics(self) -> dict[str, float]:
        try:
            text = httpx.get(self.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        return {name: float(value) for name, value in _METRIC.findall(text)}

    def log_text(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def _sampler(servers: list[Server], series: list[dict], stop: threading.Event,
             every: float, t0: float) -> None:
    while not stop.is_set():
        row = {"t_s": round(time.monotonic() - t0, 3)}
        for s in servers:
            m = s.metrics()
            row[f"{s.name}_committed_bytes"] = m.get("vllm:kv_cache_committed_bytes", float("nan"))
        series.append(row)
        stop.wait(every)


def check_prompt_fits(url: str, model: str, prompt: str, max_tokens: int) -> None:
    """Exit with the numbers when a burst's prompt + max_tokens exceeds the context.

    `--input-words` counts words; the tokenizer makes ~4.4 tokens of each of the
    random words (1500 words were 6600 tokens on the H200, 2026-12-02: every
    request a 400 and a run that measured nothing).
    """
    tokens = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prompt},
                        timeout=60).json()["count"]
    info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    limit = info.get("max_model_len")
    if limit is not None and tokens + max_tokens > limit:
        raise SystemExit(f"a prompt is {tokens} tokens; with --max-tokens {max_tokens} that "
                         f"exceeds max_model_len {limit}: lower --input-words")


def run_mode(mode: str, args: argparse.Namespace, log_dir: str) -> dict:
    extra = shlex.split(args.elastic_args if mode == "elastic" else args.static_args)
    common = [*([args.model] if args.model else []), *shlex.split(args.server_args)]
    env = {"VLLM_ELASTIC_KV_SHRINK_DELAY_S": str(args.shrink_delay_s)}
    servers = []
    try:
        for name in ("A", "B"):  # one after the other: B sizes itself beside A
            server = Server(f"{mode}_{name}", [*common, *extra], env, log_dir)
            servers.append(server)
            server.wait_ready(args.start_timeout)
        before = [s.metrics() for s in servers]
        series: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()
        sampler = threading.Thread(target=_sampler, args=(servers, series, stop,
                                                           args.sample_s, t0), daemon=True)
        sampler.start()
        results = []
        for i in range(args.bursts):
            server = servers[i % 2]
            prompts = make_prompts(args.burst_requests, args.input_words, seed=i)
            model = resolve_model(server.url, {})
            if i == 0:
                check_prompt_fits(server.url, model, prompts[0], args.max_tokens)
            level = asyncio.run(run_level(server.url, model, args.burst_requests, prompts,
                                          args.max_tokens, True, {}))
            if level["failed"] == args.burst_requests:
                raise SystemExit(f"every request of burst {i} ({server.name}) failed, e.g. "
                                 f"{level['errors'][:1]}; server log: {server.log_path}")
            level["server"] = server.name
            results.append(level)
            time.sleep(args.gap_s)
        duration = time.monotonic() - t0
        stop.set()
        sampler.join()
        after = [s.metrics() for s in servers]
        return _summarize(mode, servers, results, series, before, after, duration)
    finally:
        for s in servers:
            s.stop()


def _summarize(mode, servers, results, series, before, after, duration) -> dict:
    import numpy as np

    tokens = sum(r["total_output_tokens"] for r in results)
    preempt = sum(a.get("vllm:num_preemptions_total", 0) - b.get("vllm:num_preemptions_total", 0)
                  for a, b in zip(after, before, strict=True))
    logs = [s.log_text() for s in servers]
    ooms = sum(("out of memory" in log.lower()) or s.proc.poll() is not None
               for s, log in zip(servers, logs, strict=True))
    p50 = [r["ttft_ms"]["p50"] for r in results]
    p99 = [r["ttft_ms"]["p99"] for r in results]
    return {
        "mode": mode,
        "tokens_served": tokens,
        "duration_s": duration,
        "output_throughput": tokens / duration,
        "ttft_ms_p50": float(np.median(p50)),  # median over bursts of each burst's p50
        "ttft_ms_p99": float(np.max(p99)),  # the worst burst's p99
        "preemptions": int(preempt),
        "failed_requests": sum(r["failed"] for r in results),
        "ooms": int(ooms),
        "graph_captures_per_server": [len(re.findall(r"Captured \d+ CUDA graphs", log))
                                      for log in logs],
        "elastic_grows": [a.get("vllm:kv_cache_elastic_grows_total", 0) for a in after],
        "elastic_shrinks": [a.get("vllm:kv_cache_elastic_shrinks_total", 0) for a in after],
        "bursts": results,
        "series": series,
    }


def write_series(results: list[dict], csv_path: str | None, png_path: str | None) -> str:
    """The committed-bytes series as CSV, and a plot where matplotlib is installed."""
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["mode", "t_s", "engine", "committed_gib"])
            for r in results:
                for row in r["series"]:
                    for key, value in row.items():
                        if key.endswith("_committed_bytes"):
                            writer.writerow([r["mode"], row["t_s"], key.split("_")[1],
                                             round(value / 2**30, 3)])
    if not png_path:
        return "no --png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: CSV only"
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 3 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        for engine in ("A", "B"):
            key = f"{r['mode']}_{engine}_committed_bytes"
            ax.plot([row["t_s"] for row in r["series"]],
                    [row.get(key, float("nan")) / 2**30 for row in r["series"]],
                    label=f"engine {engine}")
        ax.set_title(f"{r['mode']}: committed KV cache")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("GiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    return png_path


MODES = ("elastic", "static")


def _modes(text: str) -> str:
    """argparse type of --modes: comma-separated names from MODES, kept as the string."""
    bad = [m for m in text.split(",") if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(map(repr, bad))}; choose from {', '.join(MODES)}")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3_8b", choices=list(SHAPES),
                   help="random-weight model shape")
    p.add_argument("--modes", type=_modes, default="elastic,static",
                   help=f"comma-separated, run in order, from {', '.join(MODES)} "
                        "(default: %(default)s)")
    p.add_argument("--bursts", type=positive_int, default=4,
                   help="bursts, alternately to engine A and B (default: %(default)s)")
    p.add_argument("--burst-requests", type=positive_int, default=256,
                   help="streaming completions per burst (default: %(default)s)")
    p.add_argument("--input-words", type=positive_int, default=650,
                   help="words per prompt (~4.4 tokens each: 650 -> ~2900 tokens)")
    p.add_argument("--max-tokens", type=positive_int, default=256,
                   help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--gap-s", type=float, default=8.0, help="idle time after each burst")
    p.add_argument("--shrink-delay-s", type=float, default=2.0,
                   help="VLLM_ELASTIC_KV_SHRINK_DELAY_S for the elastic servers")
    p.add_argument("--sample-s", type=positive_float, default=0.5,
                   help="seconds between two reads of both servers' /metrics "
                        "(default: %(default)s)")
    p.add_argument("--start-timeout", type=positive_float, default=600.0,
                   help="seconds a server may take to start (default: %(default)s)")
    p.add_argument("--server-args", default="--load-format dummy --max-model-len 4096",
                   help="`vllm serve` flags of every server (default: %(default)s)")
    p.add_argument("--elastic-args", default="--enable-elastic-kv-cache",
                   help="added for the elastic mode (default: %(default)s)")
    p.add_argument("--static-args", default="--gpu-memory-utilization 0.45",
                   help="added for the static mode (default: %(default)s)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the bundled model, 2 bursts of 4 short requests")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--csv", help="write the committed-bytes time series here")
    p.add_argument("--png", help="plot the committed-bytes time series here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model = None
        args.bursts, args.burst_requests, args.input_words, args.max_tokens = 2, 4, 40, 8
        args.gap_s, args.shrink_delay_s, args.sample_s = 2.0, 0.5, 0.5
        args.server_args = ("--max-model-len 256 --max-num-seqs 8 --max-num-batched-tokens 256 "
                            "--disable-log-stats")
        args.elastic_args = "--enable-elastic-kv-cache --kv-cache-memory-bytes 256MiB"
        args.static_args = "--kv-cache-memory-bytes 128MiB"
    else:
        args.model = model_dir_for(args.shape)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="bench-elastic-")
    results = [run_mode(mode, args, log_dir) for mode in args.modes.split(",")]
    by_mode = {r["mode"]: r for r in results}
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "log_dir": log_dir, "results": results}
    if {"elastic", "static"} <= by_mode.keys():
        e, s = by_mode["elastic"], by_mode["static"]
        out["ratio"] = {
            "output_throughput_elastic_over_static": e["output_throughput"]
            / max(s["output_throughput"], 1e-9),
            "ttft_p99_elastic_over_static": e["ttft_ms_p99"] / max(s["ttft_ms_p99"], 1e-9),
        }
    out["plot"] = write_series(results, args.csv, args.png)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
