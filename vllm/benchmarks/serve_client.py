"""The OpenAI-API client side of the serving benchmarks: one streaming request, one level.

`run_level` sends a list of prompts to `/v1/completions` with at most C in
flight (optionally at a Poisson request rate), every request streaming, so each
one measures its time to first token (TTFT), the gaps between its content
chunks (inter-token latency, ITL), its time per output token after the first
(TPOT) and its end-to-end latency; token counts come from the usage chunk.
`benchmarks/benchmark_serving.py` (a concurrency sweep) and `vllm bench serve`
are both built on it.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
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
    prompt_tokens: int = 0
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
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
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
                    max_tokens: int, ignore_eos: bool, headers: dict[str, str],
                    request_rate: float = float("inf"), progress=None, seed: int = 0) -> dict:
    """Send `prompts` with at most `concurrency` in flight (and, when `request_rate` is
    finite, Poisson arrivals at that many requests/s); the level's figures as a dict."""
    url = base_url.rstrip("/") + "/v1/completions"
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits,
                                 headers=headers) as client:

        async def bounded(prompt: str, delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            async with semaphore:
                result = await one_request(client, url, model, prompt, max_tokens, ignore_eos)
            if progress is not None:
                progress.update(1)
            return result

        start = time.perf_counter()
        delays = _arrival_delays(len(prompts), request_rate, seed)
        results = await asyncio.gather(*(bounded(p, d) for p, d in zip(prompts, delays,
                                                                          strict=True)))
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
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "tpot_ms": _summary_ms([(r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
                                for r in ok if r.output_tokens > 1]),
        "ttft_ms": _summary_ms([r.ttft_s for r in ok]),
        "itl_ms": _summary_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _summary_ms([r.e2e_s for r in ok]),
    }


def _arrival_delays(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at once for an infinite
    rate, else a Poisson process (exponential gaps with mean 1 / request_rate), as vLLM."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(np.cumsum(rng.exponential(1.0 / request_rate, n)) - 0.0)


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


