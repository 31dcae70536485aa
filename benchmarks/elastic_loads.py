"""The traffic of benchmark_elastic.py: two loads, two arrival patterns, and the waves of
streamed completions that carry them to several `vllm serve` engines at once.

A *plan* is a list of waves run one after the other (`gap_s` of silence between
two). A wave gives each engine it involves a stream of arrivals (seconds after
the wave's start, prompt, max_tokens); it ends when every request in it has
finished. The patterns:

- `alternating`: wave k is one burst of the load's requests, all sent at once, to
  engine k mod N: one engine busy while the others idle, rotating.
- `poisson`: one wave in which every engine gets its own stream of the load's
  requests, Poisson arrivals whose rate switches every `phase_s` seconds between
  a high and a low rate; engine i is high in the phases p with p mod N == i, so
  the peaks rotate across the engines while the others trickle. (kvcached's
  `bench_latency_benefit` drives each model with a per-second rate schedule that
  ramps up and down, the models' schedules staggered by a launch delay; this is
  the same idea with two levels and exponential gaps.)

Figures are client-side, as in `vllm.benchmarks.serve_client`: TTFT (send to first
token), ITL (gaps between content chunks), output tokens from the usage chunk.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass, field

import numpy as np

from vllm.benchmarks.serve_client import (
    RequestResult,
    client_session,
    make_prompts,
    one_request,
)


@dataclass(frozen=True)
class Load:
    """One load: `requests` per burst (alternating) or per engine stream (poisson).

    `input_words` are random words of ~4.4 tokens each (the benchmark tokenizer's
    rate; 650 words ~ 2,900 tokens); `high_rate` / `low_rate` are requests/s of one
    engine's poisson stream in its high / low phases.
    """

    name: str
    requests: int
    input_words: int
    max_tokens: int
    high_rate: float
    low_rate: float


LOADS = {
    # 192 x ~2,900 prompt tokens / 128 out; ~25k prompt tokens/s in a high phase.
    "prefill-heavy": Load("prefill-heavy", 192, 650, 128, high_rate=8.0, low_rate=0.5),
    # 256 x ~450 prompt tokens / 1,024 out: the stream's requests decode for long.
    "decode-heavy": Load("decode-heavy", 256, 100, 1024, high_rate=16.0, low_rate=0.5),
}
PATTERNS = ("alternating", "poisson")


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the wave's start
    prompt: str
    max_tokens: int


@dataclass
class Wave:
    streams: dict[int, list[Arrival]]  # engine index -> its arrivals, in time order


@dataclass
class WaveResult:
    """What each engine's stream of one wave saw: results in arrival order and the
    seconds from the wave's start until its last request ended."""

    results: dict[int, list[RequestResult]] = field(default_factory=dict)
    duration_s: dict[int, float] = field(default_factory=dict)


def switching_poisson_times(n: int, rate_of_phase, phase_s: float,
                            rng: np.random.Generator) -> list[float]:
    """`n` arrival times (s) of a Poisson process whose rate is `rate_of_phase(p)` (> 0,
    requests/s) during [p x phase_s, (p + 1) x phase_s). At a phase boundary the draw
    restarts at the new rate (exponential gaps are memoryless, so this is exact)."""
    times: list[float] = []
    t = 0.0
    while len(times) < n:
        phase = int(t // phase_s)
        end = (phase + 1) * phase_s
        gap = rng.exponential(1.0 / rate_of_phase(phase))
        if t + gap >= end:
            t = end
            continue
        t += gap
        times.append(t)
    return times


def make_plan(load: Load, pattern: str, engines: int, *, scale: float, bursts: int,
              phase_s: float, high_rate: float | None = None,
              low_rate: float | None = None, seed: int = 0) -> list[Wave]:
    """The waves of one (load, pattern) experiment for `engines` engines.

    Args:
        scale: multiplies the load's request count (rounded, at least 1).
        bursts: waves of the alternating pattern (wave k to engine k mod N).
        phase_s, high_rate, low_rate: the poisson pattern's phase length (s) and
            rates (requests/s of one engine; None: the load's).
    """
    n = max(1, round(load.requests * scale))
    if pattern == "alternating":
        return [Wave({k % engines: [Arrival(0.0, p, load.max_tokens) for p in
                                    make_prompts(n, load.input_words, seed=seed + k)]})
                for k in range(bursts)]
    if pattern != "poisson":
        raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
    high = load.high_rate if high_rate is None else high_rate
    low = load.low_rate if low_rate is None else low_rate
    streams = {}
    for i in range(engines):
        rng = np.random.default_rng([seed, i])
        times = switching_poisson_times(
            n, lambda p, i=i: high if p % engines == i else low, phase_s, rng)
        prompts = make_prompts(n, load.input_words, seed=seed + 1000 * (i + 1))
        streams[i] = [Arrival(t, p, load.max_tokens) for t, p in zip(times, prompts,
                                                                     strict=True)]
    return [Wave(streams)]


async def _send_stream(arrivals: list[Arrival], url: str, model: str,
                       start: float) -> list[RequestResult]:
    async with client_session(None) as client:

        async def send(arrival: Arrival) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
            return await one_request(client, url + "/v1/completions", model, arrival.prompt,
                                     arrival.max_tokens, True)

        return list(await asyncio.gather(*(send(a) for a in arrivals)))


def _engine_client(conn, arrivals: list[Arrival], url: str, model: str) -> None:
    """A client process: say ready, receive the wave's start (perf_counter, a clock
    shared by the processes of the machine), send the stream, send back (results, the
    seconds from the start until the last request ended)."""
    conn.send("ready")
    start = conn.recv()
    results = asyncio.run(_send_stream(arrivals, url, model, start))
    conn.send((results, time.perf_counter() - start))
    conn.close()


def run_wave(wave: Wave, targets: dict[int, tuple[str, str]]) -> WaveResult:
    """Send the streams of `wave` whose engine is in `targets` (index -> (server URL,
    model id)) at their arrival times, every request streaming with ignore_eos; the
    others are skipped (an engine run alone gets only its own stream).

    With several engines each one's stream is sent from a process of its own, so the
    client keeps up with three engines' streamed chunks (tens of thousands a second)
    and one engine's chunks never delay another's timestamps; a single stream is sent
    from this process.
    """
    mine = [i for i in wave.streams if i in targets]
    if len(mine) == 1:
        (i,) = mine
        start = time.perf_counter()
        results = asyncio.run(_send_stream(wave.streams[i], *targets[i], start))
        return WaveResult({i: results}, {i: time.perf_counter() - start})
    ctx = multiprocessing.get_context("spawn")
    clients = {}
    out = None
    try:
        for i in mine:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_engine_client, args=(child, wave.streams[i],
                                                            *targets[i]), daemon=True)
            proc.start()
            child.close()  # so that a client's death is an EOFError here, not a hang
            clients[i] = (proc, conn)
        for _, conn in clients.values():
            conn.recv()  # EOFError if a client died while starting
        start = time.perf_counter() + 0.1
        for _, conn in clients.values():
            conn.send(start)
        result = WaveResult()
        for i, (_, conn) in clients.items():
            result.results[i], result.duration_s[i] = conn.recv()
        out = result
        return out
    finally:  # after an error (or SIGTERM) the clients still streaming go at once
        for proc, _ in clients.values():
            proc.join(timeout=10 if out is not None else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else 0.0


def latency_figures(results: list[RequestResult]) -> dict:
    """Tokens, failures and TTFT p50 / p99, ITL p99 (ms) over `results` pooled."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    return {
        "requests": len(results),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "tokens_served": sum(r.output_tokens for r in ok),
        "ttft_ms_p50": _ms(ttft, 50),
        "ttft_ms_p99": _ms(ttft, 99),
        "itl_ms_p99": _ms(itl, 99),
    }


def plan_duration(waves: list[WaveResult], gap_s: float) -> float:
    """Seconds the plan took: each wave lasts until its slowest engine's stream ended,
    plus the gaps between waves. For engines run one at a time (mode `alone`) the
    waves' per-engine durations come from separate runs: the figure is then what the
    plan would take with each engine on a device of its own."""
    busy = sum(max(w.duration_s.values(), default=0.0) for w in waves)
    return busy + gap_s * max(len(waves) - 1, 0)

