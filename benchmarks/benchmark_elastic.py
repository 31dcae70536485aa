"""N `vllm serve` engines of different shapes on one device: elastic KV cache against a
static 1/N split and against each engine alone on the device (the upper bound).

Question (issue #49): on every load and arrival pattern, do N engines with
`--enable-elastic-kv-cache` serve at least as many tokens per second, with a TTFT
p99 no worse, than the same engines splitting the device statically, with no OOM
and no CUDA graph re-capture, and how close do they come to each engine alone?

Modes, each in its own run of the servers (`--modes`, in order):

    elastic   each engine at default flags + --enable-elastic-kv-cache
    static    each engine at --gpu-memory-utilization (--static-utilization / N)
    alone     each engine at default flags, alone on the device, serving its
              share of the traffic; the durations are combined as if each
              engine had a device of its own (the upper bound)

`--device-gib G` runs every mode on an emulated device of G GiB (a ballast
process holds the rest, and the servers size against G GiB:
`VLLM_EMULATED_DEVICE_GIB`), so a quick run at `--scale` < 1 keeps the full loads'
memory pressure. The servers of a mode start one after the other (each sizes itself beside the
ones already running) and serve every (load, pattern) experiment in turn
(`--load`, `--pattern`; see benchmarks/elastic_loads.py), with a settle between
two experiments until the elastic engines are back at their start-up size (at
most `--settle-s`). A sampler reads every server's `/metrics` each `--sample-s`:
committed, in-use, reclaimable bytes and the limit of the KV cache (the last
three where the server exports them). Per experiment and mode:

    tokens served, duration, output throughput, TTFT p50 / p99, ITL p99 (ms),
    preemptions, failed requests, OOMs (a server died or logged "out of
    memory"), CUDA graph captures per engine ("Captured ... CUDA graphs
    (decode)" log lines: 1 = never re-captured), the same per engine, and per
    engine each request's send time, TTFT, end-to-end time and output tokens
    (`per_request`)

and the ratios elastic / static and elastic / alone (throughput, TTFT p99, ITL
p99), with the issue's targets checked (`targets`). JSON to stdout and `--out`
(rewritten after every experiment, so a run cut short keeps what it measured);
the sampled series to `--csv` and, where matplotlib is installed, a plot to `--png`.

    python benchmarks/benchmark_elastic.py --shapes llama3_8b llama3_8b \\
        --out benchmarks/results/elastic_8b_pair.json --csv e.csv --png e.png
    python benchmarks/benchmark_elastic.py --engines 3 --load decode-heavy \\
        --pattern poisson                 # 8B + Llama-3.2-1B + Qwen2.5-0.5B shapes
    python benchmarks/benchmark_elastic.py --smoke   # CPU, the bundled model, tiny loads
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))


from common import SHAPES, ServeProcess, emit, model_dir_for
from elastic_loads import (
    LOADS,
    PATTERNS,
    WaveResult,
    latency_figures,
    make_plan,
    plan_duration,
    run_wave,
)
from elastic_plot import GAUGES, write_series  # the sampled gauges; absent ones stay None

from vllm.benchmarks.serve_client import resolve_model
from vllm.benchmarks.utils import positive_float, positive_int

_METRIC = re.compile(r'^(vllm:[a-z_]+)\{[^}]*\} ([0-9.e+-]+)$', re.M)
# The decode graphs' line: one per start-up (the mixed-batch and verify graphs log
# lines of their own, "(mixed steps, ...)" / "(verify, ...)", in the same capture).
_CAPTURE = re.compile(r"Captured \d+ CUDA graphs \(decode\)")
MODES = ("elastic", "static", "alone")
DEFAULT_SHAPES = ("llama3_8b", "llama3_2_1b", "qwen2_5_0_5b")
NAMES = "ABC"
COUNTERS = {
    "elastic_grows": "vllm:kv_cache_elastic_grows_total",
    "elastic_shrinks": "vllm:kv_cache_elastic_shrinks_total",
    "elastic_reclaims": "vllm:kv_cache_elastic_reclaims_total",
}


class Server(ServeProcess):
    """One `vllm serve` subprocess on a free port, its log in `log_dir`/`name`.log."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: str) -> None:
        super().__init__([*args, "--uvicorn-log-level", "warning"], env=env,
                         log_path=os.path.join(log_dir, f"{name}.log"))
        self.name = name
        self.model = ""

    def wait_ready(self, timeout_s: float, path: str = "/health", verify=True) -> str:
        """`ServeProcess.wait_ready`, then the name of the model it serves in `model`."""
        super().wait_ready(timeout_s, path, verify)
        self.model = resolve_model(self.url, {})
        return self.url

    def metrics(self) -> dict[str, float]:
        try:
            text = httpx.get(self.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        return {name: float(value) for name, value in _METRIC.findall(text)}

    def oom(self) -> bool:
        """The server died or logged an out-of-memory error."""
        return self.proc.poll() is not None or "out of memory" in self.log().lower()

    def graph_captures(self) -> int:
        return len(_CAPTURE.findall(self.log()))


_BALLAST = """
import sys, time, torch
keep = int(float(sys.argv[1]) * 2**30)
free, total = torch.cuda.mem_get_info()
size = max(free - keep, 0)  # 0: the device is no larger than asked, nothing to hold
held = torch.empty(size, dtype=torch.uint8, device="cuda") if size else None
print(f"ballast {size / 2**30:.2f} GiB held, {free / 2**30:.2f} free of "
      f"{total / 2**30:.2f} GiB", flush=True)
while size:
    time.sleep(3600)
"""


class Ballast:
    """A process holding all free device memory but `gib` GiB while the modes run, so they
    run on an emulated device of `gib` GiB: a quick run (--scale < 1) keeps the full
    loads' memory pressure on a larger card. Its CUDA context counts as held."""

    def __init__(self, gib: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BALLAST, str(gib)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.line = self.proc.stdout.readline().strip()
        if not self.line.startswith("ballast"):
            rest = (self.line + "\n" + self.proc.communicate()[0]).strip().splitlines()
            raise SystemExit(f"--device-gib {gib}: the ballast process failed: {rest[-1]}")
        words = self.line.split()
        # Where it holds nothing, the device itself is the emulated one.
        self.fraction = gib / float(words[-2]) if float(words[1]) else 1.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def stop_all(servers: list[Server]) -> None:
    """SIGTERM every server at once, then wait for each (killed after 60 s)."""
    for s in servers:
        s.request_stop()
    for s in servers:
        s.stop(60)


def _sample(servers: dict[str, Server], series: list[dict], stop: threading.Event,
            every: float) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        row: dict = {"t_s": round(time.monotonic() - t0, 3)}
        for name, s in servers.items():
            m = s.metrics()
            for key, metric in GAUGES.items():
                row[f"{name}_{key}"] = m.get(metric)
        series.append(row)
        stop.wait(every)


def check_prompt_fits(server: Server, prompt: str, max_tokens: int) -> None:
    """Exit with the numbers when a prompt + max_tokens exceeds the server's context.

    A load's `input_words` count words; the tokenizer makes ~4.4 tokens of each
    (1500 words were 6600 tokens on the H200, 2026-12-02: every request a 400).
    """
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": server.model,
                                                        "prompt": prompt},
                        timeout=60).json()["count"]
    info = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    limit = info.get("max_model_len")
    if limit is not None and tokens + max_tokens > limit:
        raise SystemExit(f"{server.name}: a prompt is {tokens} tokens; with max_tokens "
                         f"{max_tokens} that exceeds max_model_len {limit}")


def _mode_flags(mode: str, args: argparse.Namespace) -> list[str]:
    """Mode flags. On an emulated device the servers' utilization is a share of it
    (`server_env`), so static splits --static-utilization of it and alone gets all of it
    (the extensible path's default utilization, 1.0); until 2026-12-07 the servers saw
    the whole card and these flags were scaled by --device-gib / the card's GiB."""
    if mode == "elastic":
        return shlex.split(args.elastic_args)
    if mode == "static":
        share = args.static_utilization / len(args.shapes)
        return ["--gpu-memory-utilization", f"{share:.4f}", *shlex.split(args.static_args)]
    return shlex.split(args.alone_args)


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The servers' variables: the shrink delay if given; on an emulated device (a ballast
    holds the rest, `args.device_fraction` < 1) its size, which the servers size against
    (`--gpu-memory-utilization`, the elastic headroom's 2 %: 1.16 GiB of 58 GiB, not 1.58
    GiB of the H100's 79 GiB)."""
    env = ({} if args.shrink_delay_s is None
           else {"VLLM_ELASTIC_KV_SHRINK_DELAY_S": str(args.shrink_delay_s)})
    if args.device_fraction < 1.0:
        env["VLLM_EMULATED_DEVICE_GIB"] = str(args.device_gib)
    return env


def start_servers(mode: str, engines: list[int], args, log_dir: str) -> dict[str, Server]:
    """The servers of `engines` (indices) for `mode`, started one after the other."""
    env = server_env(args)
    servers: dict[str, Server] = {}
    try:
        for i in engines:
            model = [] if args.smoke else [model_dir_for(args.shapes[i])]
            name = NAMES[i]
            servers[name] = Server(f"{mode}_{name}", [*model, *shlex.split(args.server_args),
                                                      *_mode_flags(mode, args)], env, log_dir)
            servers[name].wait_ready(args.start_timeout)
    except BaseException:
        stop_all(list(servers.values()))
        raise
    return servers


def settle(servers: dict[str, Server], floors: dict[str, float | None],
           limit_s: float) -> float:
    """Wait until every server's committed KV bytes are back at `floors` (its size after
    start-up; None: not exported, not waited for), at most `limit_s`; the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        now = {n: s.metrics().get(GAUGES["committed_bytes"]) for n, s in servers.items()}
        if all(None in (now[n], floors[n]) or now[n] <= floors[n] for n in servers):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def run_experiment(key: tuple[str, str], plan, indices: list[int],
                   servers: dict[str, Server], args) -> dict:
    """One plan against `servers` (engines `indices`): the waves' results, per-engine
    preemptions, the sampled series and the servers' OOMs / graph captures."""
    before = {n: s.metrics() for n, s in servers.items()}
    series: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(servers, series, stop, args.sample_s),
                               daemon=True)
    sampler.start()
    targets = {i: (servers[NAMES[i]].url, servers[NAMES[i]].model) for i in indices}
    waves: list[WaveResult | None] = []
    try:
        ran = 0
        for wave in plan:
            if not set(wave.streams) & set(indices):
                waves.append(None)
                continue
            if ran:
                time.sleep(args.gap_s)
            result = run_wave(wave, targets)
            ran += 1
            for i, results in result.results.items():
                if results and all(not r.ok for r in results):
                    server = servers[NAMES[i]]
                    raise SystemExit(f"{key}: every request to {server.name} failed, e.g. "
                                     f"{results[0].error}; server log: {server.log_path}")
            waves.append(result)
    finally:
        stop.set()
        sampler.join()
    after = {n: s.metrics() for n, s in servers.items()}
    preempt = {n: int(after[n].get("vllm:num_preemptions_total", 0)
                      - before[n].get("vllm:num_preemptions_total", 0)) for n in servers}
    return {"waves": waves, "preemptions": preempt, "series": series,
            "ooms": {n: s.oom() for n, s in servers.items()},
            "graph_captures": {n: s.graph_captures() for n, s in servers.items()},
            "counters": {n: {k: after[n].get(m) for k, m in COUNTERS.items()}
                         for n in servers}}


def _merge(runs: list[dict], n_waves: int) -> dict:
    """The runs of one experiment by groups of engines (one group, or one per engine when
    `alone`) as one: waves merged per index, per-engine figures side by side."""
    waves = [WaveResult() for _ in range(n_waves)]
    merged: dict = {"preemptions": {}, "series": [], "ooms": {}, "graph_captures": {},
                    "counters": {}}
    for run in runs:
        for k, wave in enumerate(run["waves"]):
            if wave is not None:
                waves[k].results.update(wave.results)
                waves[k].duration_s.update(wave.duration_s)
        for field in ("preemptions", "ooms", "graph_captures", "counters"):
            merged[field].update(run[field])
        merged["series"].extend(run["series"])
    merged["waves"] = [w for w in waves if w.results]
    return merged


def per_request(waves: list[WaveResult], i: int, shared: bool = True) -> list[list]:
    """Engine `i`'s requests in `waves`, each [wave index, sent (s after the wave's first
    send: of any engine when the engines ran together (`shared`), else of this one),
    TTFT (ms), end to end (s), output tokens] (failed: TTFT -1)."""
    rows = []
    for k, wave in enumerate(waves):
        if i not in wave.results:
            continue
        mine = wave.results[i]
        t0 = min((r.start_s for rs in (wave.results.values() if shared else [mine])
                  for r in rs), default=0.0)
        rows += [[k, round(r.start_s - t0, 3), round(r.ttft_s * 1000, 1) if r.ok else -1,
                  round(r.e2e_s, 3), r.output_tokens] for r in mine]
    return rows


def summarize(mode: str, run: dict, args) -> dict:
    """One mode's figures of one experiment (a `_merge`d run): pooled over its engines,
    and per engine (its throughput over the time its own streams took)."""
    waves = run["waves"]
    names = sorted(run["ooms"])
    results = {NAMES.index(n): [r for w in waves for r in w.results.get(NAMES.index(n), [])]
               for n in names}
    figures = latency_figures([r for rs in results.values() for r in rs])
    duration = plan_duration(waves, args.gap_s)
    per_engine = {}
    for n in names:
        i = NAMES.index(n)
        mine = [w for w in waves if i in w.results]
        engine = latency_figures(results[i])
        engine["per_request"] = per_request(waves, i, shared=mode != "alone")
        busy = sum(w.duration_s[i] for w in mine) + args.gap_s * max(len(mine) - 1, 0)
        engine.update(shape=args.shapes[i], output_throughput=engine["tokens_served"]
                      / max(busy, 1e-9), preemptions=run["preemptions"][n],
                      oom=run["ooms"][n], graph_captures=run["graph_captures"][n],
                      **(run["counters"][n] or {}))
        per_engine[n] = engine
    return {
        "mode": mode, **figures, "duration_s": duration,
        "output_throughput": figures["tokens_served"] / max(duration, 1e-9),
        "preemptions": sum(run["preemptions"].values()),
        "ooms": sum(run["ooms"].values()),
        "graph_captures_per_engine": [run["graph_captures"][n] for n in names],
        "engines": per_engine, "series": run["series"],
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def compare(load: str, pattern: str, by_mode: dict[str, dict]) -> dict:
    """Ratios elastic / static and elastic / alone, and the issue's targets."""
    out: dict = {}
    e = by_mode.get("elastic")
    for peer in ("static", "alone"):
        if e and peer in by_mode:
            p = by_mode[peer]
            out[f"elastic_over_{peer}"] = {
                k: _ratio(e[k], p[k]) for k in ("output_throughput", "ttft_ms_p99", "itl_ms_p99")}
    s = out.get("elastic_over_static")
    if s is None:
        return out
    targets = {
        "throughput_ge_static": s["output_throughput"] is not None
        and s["output_throughput"] >= 1.0,
        "ttft_p99_le_static": s["ttft_ms_p99"] is not None and s["ttft_ms_p99"] <= 1.0,
        "zero_oom": e["ooms"] == 0,
        # None on the CPU (no CUDA graphs)
        "one_graph_capture_per_engine": all(c == 1 for c in e["graph_captures_per_engine"])
        if any(e["graph_captures_per_engine"]) else None,
    }
    if (load, pattern) == ("decode-heavy", "poisson"):
        targets["ttft_p99_le_half_static"] = (s["ttft_ms_p99"] is not None
                                             and s["ttft_ms_p99"] <= 0.5)
        targets["throughput_ge_1_2x_static"] = (s["output_throughput"] is not None
                                               and s["output_throughput"] >= 1.2)
    out["targets"] = targets
    return out


def run_mode(mode: str, plans: dict, args, log_dir: str, done) -> None:
    """Every experiment of `plans` under `mode`; `done(key, mode, summary)` after each."""
    n = len(args.shapes)
    groups = [[i] for i in range(n)] if mode == "alone" else [list(range(n))]
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in plans}
    for g, indices in enumerate(groups):
        servers = start_servers(mode, indices, args, log_dir)
        try:
            floors = {name: s.metrics().get(GAUGES["committed_bytes"])
                      for name, s in servers.items()}
            for plan in plans.values():  # the first prompt of each plan (a load's are alike)
                arrival = next(iter(plan[0].streams.values()))[0]
                for i in indices:
                    check_prompt_fits(servers[NAMES[i]], arrival.prompt, arrival.max_tokens)
            for k, (key, plan) in enumerate(plans.items()):
                runs[key].append(run_experiment(key, plan, indices, servers, args))
                if k < len(plans) - 1:
                    settle(servers, floors, args.settle_s)
                if g == len(groups) - 1:
                    done(key, mode, summarize(mode, _merge(runs[key], len(plan)), args))
        finally:
            stop_all(list(servers.values()))


def _engines(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Resolve --engines / --shapes into args.shapes (one shape per engine)."""
    if args.shapes is None:
        args.shapes = list(DEFAULT_SHAPES[:args.engines or 2])
    elif args.engines is not None and args.engines != len(args.shapes):
        parser.error(f"--engines {args.engines} but {len(args.shapes)} --shapes given")
    if len(args.shapes) not in (2, 3):
        parser.error(f"2 or 3 engines, got {len(args.shapes)} --shapes")
    args.engines = len(args.shapes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=positive_int, choices=(2, 3),
                   help="engines on the device (default: 2, or as many as --shapes)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                   help="one random-weight shape per engine (default: the first N of "
                        f"{', '.join(DEFAULT_SHAPES)})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="run in order, each with its own servers (default: all)")
    p.add_argument("--load", nargs="+", choices=list(LOADS),
                   help="loads (benchmarks/elastic_loads.py; default: both, with --smoke "
                        "decode-heavy)")
    p.add_argument("--pattern", nargs="+", choices=PATTERNS, default=list(PATTERNS),
                   help="arrival patterns (default: both)")
    p.add_argument("--scale", type=positive_float, default=1.0,
                   help="multiplies every load's request count (default: %(default)s)")
    p.add_argument("--bursts", type=positive_int,
                   help="alternating: bursts, rotating across the engines (default: N)")
    p.add_argument("--gap-s", type=float, default=4.0,
                   help="alternating: idle seconds between two bursts (default: %(default)s)")
    p.add_argument("--phase-s", type=positive_float, default=10.0,
                   help="poisson: seconds of each rate phase (default: %(default)s)")
    p.add_argument("--high-rate", type=positive_float,
                   help="poisson: requests/s of an engine in its high phase (default: the "
                        "load's)")
    p.add_argument("--low-rate", type=positive_float,
                   help="poisson: requests/s of an engine in a low phase (default: the load's)")
    p.add_argument("--seed", type=int, default=0, help="prompts' and arrivals' seed")
    p.add_argument("--settle-s", type=positive_float, default=30.0,
                   help="after each experiment, wait at most this long for the elastic "
                        "engines to be back at their start-up size (default: %(default)s)")
    p.add_argument("--shrink-delay-s", type=float,
                   help="VLLM_ELASTIC_KV_SHRINK_DELAY_S of the servers (default: unset, the "
                        "engine's 10 s; --smoke: 0.5)")
    p.add_argument("--sample-s", type=positive_float, default=0.5,
                   help="seconds between two reads of the servers' /metrics "
                        "(default: %(default)s)")
    p.add_argument("--start-timeout", type=positive_float, default=600.0,
                   help="seconds a server may take to start (default: %(default)s)")
    p.add_argument("--server-args", default="--load-format dummy --max-model-len 4096",
                   help="`vllm serve` flags of every server (default: %(default)s)")
    p.add_argument("--elastic-args", default="--enable-elastic-kv-cache",
                   help="added in mode elastic (default: %(default)s)")
    p.add_argument("--static-utilization", type=positive_float, default=0.9,
                   help="mode static: the device fraction the engines split evenly, each "
                        "--gpu-memory-utilization of it / N (default: %(default)s)")
    p.add_argument("--static-args", default="", help="more flags of mode static")
    p.add_argument("--alone-args", default="", help="flags of mode alone (default: none)")
    p.add_argument("--device-gib", type=positive_float,
                   help="emulate a device of this many GiB: a ballast process holds the rest "
                        "during every mode; static splits --static-utilization of it, alone "
                        "gets all of it (GPU only)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the bundled model's shape (random weights), tiny loads of 4 "
                        "requests")
    p.add_argument("--log-dir", help="server logs here (default: a new temporary directory)")
    p.add_argument("--out", help="also write the JSON here (after every experiment)")
    p.add_argument("--csv", help="write the sampled KV series here (GiB)")
    p.add_argument("--png", help="plot committed KV bytes over time here (matplotlib, else "
                                 "Pillow)")
    p.add_argument("--replot", metavar="JSON",
                   help="run nothing: write --csv / --png from this earlier --out")
    args = p.parse_args(argv)
    if args.smoke and args.shapes is None:
        args.shapes = ["smollm2"] * (args.engines or 2)  # labels only: the bundled model
    _engines(args, p)
    if args.smoke and args.device_gib:
        p.error("--device-gib needs a GPU; --smoke runs on the CPU")
    args.device_fraction = 1.0  # --device-gib / the device's GiB, once the ballast holds
    args.bursts = args.bursts or args.engines
    args.load = args.load or (["decode-heavy"] if args.smoke else list(LOADS))
    args.loads = dict(LOADS)
    if args.smoke:
        args.loads = {"prefill-heavy": replace(LOADS["prefill-heavy"], requests=4,
                                               input_words=40, max_tokens=4,
                                               high_rate=8.0, low_rate=2.0),
                      "decode-heavy": replace(LOADS["decode-heavy"], requests=4,
                                              input_words=8, max_tokens=8,
                                              high_rate=8.0, low_rate=2.0)}
        args.gap_s, args.phase_s, args.shrink_delay_s = 0.5, 1.0, 0.5
        args.sample_s, args.settle_s = 0.5, min(args.settle_s, 5.0)
        args.server_args = ("--load-format dummy --max-model-len 256 --max-num-seqs 8 "
                            "--max-num-batched-tokens 256 --disable-log-stats")
        args.elastic_args = "--enable-elastic-kv-cache --kv-cache-memory-bytes 256MiB"
        args.static_args = f"--kv-cache-memory-bytes {256 // args.engines}MiB"
        args.alone_args = "--kv-cache-memory-bytes 256MiB"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        experiments = json.loads(Path(args.replot).read_text())["experiments"]
        print(write_series(experiments, args.csv, args.png))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the servers
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench-elastic-")
    os.makedirs(log_dir, exist_ok=True)
    plans = {(load, pattern): make_plan(args.loads[load], pattern, args.engines,
                                        scale=args.scale, bursts=args.bursts,
                                        phase_s=args.phase_s, high_rate=args.high_rate,
                                        low_rate=args.low_rate, seed=args.seed)
             for load in args.load for pattern in args.pattern}
    by_key: dict[tuple[str, str], dict[str, dict]] = {key: {} for key in plans}
    config = {k: v for k, v in vars(args).items() if k not in ("out", "loads")}
    config["loads"] = {name: vars(load) for name, load in args.loads.items()}
    out: dict = {"config": config, "log_dir": log_dir,
                 "engines": [{"name": NAMES[i], "shape": s} for i, s in enumerate(args.shapes)],
                 "experiments": []}

    def done(key: tuple[str, str], mode: str, summary: dict) -> None:
        by_key[key][mode] = summary
        out["experiments"] = [{"load": k[0], "pattern": k[1], "modes": modes,
                               **compare(k[0], k[1], modes)}
                              for k, modes in by_key.items() if modes]
        out["plot"] = write_series(out["experiments"], args.csv, args.png)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))

    ballast = Ballast(args.device_gib) if args.device_gib else None
    try:
        if ballast:
            args.device_fraction = ballast.fraction
            out["ballast"] = ballast.line
            out["config"]["device_fraction"] = args.device_fraction
        for mode in args.modes:
            run_mode(mode, plans, args, log_dir, done)
    finally:
        if ballast:
            ballast.stop()
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
