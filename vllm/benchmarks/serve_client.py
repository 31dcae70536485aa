"""The OpenAI-API client side of the serving benchmarks: one streaming request, one level.

`run_level` sends a list of prompts to `/v1/completions` with at most C in
flight (optionally at a Poisson request rate), every request streaming, so each
one measures its time to first token (TTFT), its inter-token latencies (ITL),
its time per output token after the first (TPOT) and its end-to-end latency;
token counts come from the usage chunk. `benchmarks/benchmark_serving.py` (a
concurrency sweep) and `vllm bench serve` are both built on it.

ITL is per token, not per chunk: every request asks for
`stream_options.continuous_usage_stats`, so each chunk says how many tokens
it carries (k, the change of `usage.completion_tokens`), and a chunk of k
tokens arriving `gap` seconds after the previous one counts k ITLs of gap / k
(as SGLang's bench_serving splits multi-token chunks). A server that
coalesces several steps' tokens into one chunk thus reads its per-token
pace, not one long gap per chunk. The first chunk's tokens count in TTFT
only; a chunk of no token (a finish reason alone) counts none.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from dataclasses import dataclass, field

import aiohttp
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


# Seconds a connect or a read may take (a long generation streams for minutes).
_TIMEOUT_S = 3600.0
# Seconds an idle connection stays open: below the server's keep-alive timeout
# (uvicorn's 5 s in `vllm serve`), so the client closes it first. The other
# way round a request sent just as the server closes its idle connection fails
# (the server resets it), a failure that says nothing about the server's load.
_KEEPALIVE_S = 2.0


@dataclass
class RequestResult:
    """One streamed request as the client saw it (seconds on `time.perf_counter`)."""

    ok: bool
    start_s: float = 0.0  # when it was sent
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # per token after the first chunk's
    num_chunks: int = 0  # content chunks (output_tokens / num_chunks: tokens per chunk)
    output_tokens: int = 0  # from the usage chunk
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""

    def token_times(self) -> list[float]:
        """Arrival time of the first chunk, then of each later token (seconds on the
        perf_counter clock; the tokens of one chunk spread evenly over the gap
        before it, as `itl_s` counts them)."""
        if not self.ok:
            return []
        first = self.start_s + self.ttft_s
        return [first, *(first + t for t in np.cumsum(self.itl_s))]


def make_prompts(n: int, input_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_words)) for _ in range(n)]


def client_session(max_connections: int | None, headers: dict[str, str] | None = None
                   ) -> aiohttp.ClientSession:
    """An aiohttp session for streaming requests: at most `max_connections` open (None: no
    limit), `headers` on every request; a connect or a read may take up to
    `_TIMEOUT_S` (a long generation is not an error), an idle connection is closed
    after `_KEEPALIVE_S`.

    aiohttp, as vLLM's benchmark client: its C HTTP parser reads an SSE chunk in a few
    microseconds. httpx, used before, spent 240 us of client CPU a chunk at
    concurrency 128 against a fake server that costs nothing (3,900 tokens/s in all,
    the server's own figure then): pure-Python h11 parsing, and httpcore 1.0's pool
    scans every connection, a syscall each, whenever a request starts or ends
    (docs/benchmarks.md, "Frontend").
    """
    connector = aiohttp.TCPConnector(limit=max_connections or 0, limit_per_host=0,
                                     keepalive_timeout=_KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=_TIMEOUT_S, sock_read=_TIMEOUT_S)
    return aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout,
                                 trust_env=False)


async def one_request(session: aiohttp.ClientSession, url: str, model: str,
                      prompt: str | list[int], max_tokens: int, ignore_eos: bool,
                      chat: bool = False, body_extra: dict | None = None) -> RequestResult:
    """Stream one request to `url` and time it.

    Args:
        session: from `client_session`.
        url: a /v1/completions URL, or /v1/chat/completions when `chat` (the
            prompt is then the user message, a str).
        prompt: text, or token ids (completions only).
        body_extra: more request fields (sampling parameters); they override
            the defaults (temperature 0).
    """
    body = _request_body(model, prompt, max_tokens, ignore_eos, chat, body_extra)
    start = time.perf_counter()
    result = RequestResult(ok=False, start_s=start)
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = _http_error(response, await response.read())
                return result
            texts = await _read_stream(response, result, start, chat)
            if texts is None:
                return result
        result.e2e_s = time.perf_counter() - start
        result.text = "".join(texts)
        result.ok = bool(texts)
        if not result.ok:
            result.error = "the stream ended without a token"
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = repr(e)
    return result


def _request_body(model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool,
                  chat: bool, body_extra: dict | None) -> dict:
    """A streaming request with a usage chunk, greedy unless `body_extra` says otherwise."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                  "ignore_eos": ignore_eos}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(body_extra or {})
    return body


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult,
                       start: float, chat: bool) -> list[str] | None:
    """Read the SSE events into `result` (TTFT, per-token ITLs, the usage's token
    counts); the chunks' texts, or None after an error event (its message in
    `result.error`). Events that arrive in one read are timed together."""
    stream = _StreamState(start, chat)
    pending = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if not stream.event(json.loads(line[6:]), now, result):
                return None
    return stream.texts


class _StreamState:
    """One stream's events so far (`_read_stream`)."""

    def __init__(self, start: float, chat: bool) -> None:
        self.start, self.chat = start, chat
        self.last: float | None = None  # arrival of the last chunk with a token
        self.texts: list[str] = []
        self.tokens_seen = 0  # usage.completion_tokens so far (continuous usage stats)

    def event(self, chunk: dict, now: float, result: RequestResult) -> bool:
        """Apply one `data:` event that arrived at `now`; False for an error event."""
        if "error" in chunk:
            result.error = chunk["error"]["message"]
            return False
        num_tokens = 1  # a server without continuous usage stats: one token a chunk
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
            result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            num_tokens = result.output_tokens - self.tokens_seen
            self.tokens_seen = result.output_tokens
        if not chunk.get("choices"):
            return True
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        # Every chunk with a choice is a token's (as vLLM's client counts them:
        # its text may be empty, e.g. half a character), except the chat API's
        # first one, which carries the role before any token exists.
        if self.chat and "role" in delta:
            return True
        text = delta.get("content") if self.chat else choice.get("text")
        self.texts.append(text or "")
        if self.last is None:
            result.ttft_s = now - self.start
        elif num_tokens > 0:
            result.itl_s.extend([(now - self.last) / num_tokens] * num_tokens)
        else:
            return True  # no token in it (a finish reason alone): no ITL, the gap goes on
        result.num_chunks += 1
        self.last = now
        return True


def _http_error(response: aiohttp.ClientResponse, body: bytes) -> str:
    """`HTTP <status>: <message>`: the message of an OpenAI-style error body, else the
    body's start, else the status's reason phrase."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace").strip() or (response.reason or "")
    return f"HTTP {response.status}: {message}"


def _summary_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}  # as vLLM: no NaN in the JSON
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99))}


async def run_requests(url: str, model: str, concurrency: int, prompts: list,
                       max_tokens: int | list[int], ignore_eos: bool,
                       headers: dict[str, str], request_rate: float = float("inf"),
                       burstiness: float = 1.0, progress=None, seed: int = 0,
                       chat: bool = False, body_extra: dict | None = None,
                       ) -> tuple[list[RequestResult], float, float]:
    """Send `prompts` to `url` with at most `concurrency` in flight; (results in prompt
    order, the start on the perf_counter clock, the seconds from it to the last reply).

    `max_tokens` is one value or one per prompt. With a finite `request_rate`
    requests arrive at that mean rate, the gaps drawn from a gamma distribution
    of shape `burstiness` (1: a Poisson process), as vLLM's `vllm bench serve`.
    """
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    semaphore = asyncio.Semaphore(concurrency)
    async with client_session(concurrency, headers) as client:

        async def bounded(prompt, n: int, delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            async with semaphore:
                result = await one_request(client, url, model, prompt, n, ignore_eos, chat,
                                           body_extra)
            if progress is not None:
                progress.update(1)
            return result

        start = time.perf_counter()
        delays = _arrival_delays(len(prompts), request_rate, seed, burstiness)
        results = await asyncio.gather(*(bounded(p, n, d) for p, n, d in zip(
            prompts, lengths, delays, strict=True)))
        duration = time.perf_counter() - start
    return list(results), start, duration


async def run_level(base_url: str, model: str, concurrency: int, prompts: list[str],
                    max_tokens: int, ignore_eos: bool, headers: dict[str, str],
                    request_rate: float = float("inf"), progress=None, seed: int = 0) -> dict:
    """Send `prompts` to /v1/completions with at most `concurrency` in flight (and, when
    `request_rate` is finite, Poisson arrivals at that many requests/s); the level's
    figures as a dict (the benchmarks/ scripts' format; `client_cpu_share`: this
    process's CPU seconds over the level's duration, near 1.0 when the client sets
    the pace)."""
    cpu_start = time.process_time()
    results, _, duration = await run_requests(
        base_url.rstrip("/") + "/v1/completions", model, concurrency, prompts, max_tokens,
        ignore_eos, headers, request_rate=request_rate, progress=progress, seed=seed)
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
        "tokens_per_chunk": output_tokens / max(sum(r.num_chunks for r in ok), 1),
        "e2e_ms": _summary_ms([r.e2e_s for r in ok]),
        "client_cpu_share": (time.process_time() - cpu_start) / duration,
    }


def _arrival_delays(n: int, request_rate: float, seed: int, burstiness: float = 1.0
                    ) -> list[float]:
    """Seconds after the start at which each request is sent: all at once for an
    infinite rate, else the first at once and then gaps from a gamma distribution of
    shape `burstiness` and mean 1 / request_rate (shape 1: exponential gaps, a Poisson
    process), as vLLM."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), max(n - 1, 0))
    return [0.0, *(float(t) for t in np.cumsum(gaps))][:n]  # the first is sent at once


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


def served_models(base_url: str, headers: dict[str, str]) -> list[dict]:
    """The server's /v1/models entries ({"id", "root", ...}); raises httpx.HTTPStatusError
    for an error status, httpx.HTTPError when nothing answers, ValueError for a body
    that is not a model list."""
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    try:
        data = response.json()["data"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{base_url}/v1/models did not answer a model list") from None
    if not isinstance(data, list):
        raise ValueError(f"{base_url}/v1/models did not answer a model list")
    return data


def resolve_model(base_url: str, headers: dict[str, str]) -> str:
    """The id of the server's first model."""
    models = served_models(base_url, headers)
    if not models:
        raise ValueError(f"the server at {base_url} serves no model")
    return models[0]["id"]
