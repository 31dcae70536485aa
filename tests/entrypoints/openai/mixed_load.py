"""A mixed, hostile load on a real `vllm serve`, checking every answer (tests and benchmark).

For `duration` seconds, over loopback, at the same time:

    streamers      chat and completion streams of random length (some n=2, some
                   with logprobs); each must end with `data: [DONE]`
    leavers        streams closed after a few events, and non-streaming requests
                   abandoned after a random delay (the server must abort them)
    hostile        malformed and hostile bodies (bad JSON, wrong types, lone
                   surrogates, huge n, negative max_tokens, non-string content
                   parts, broken chat templates, over-long and empty prompts,
                   deep nesting, a 2 MB prompt, unknown routes); each must get a
                   4xx with the OpenAI error body
    long prompts   completions near max_model_len
    sleeper        level-1 (and every third cycle level-2) sleep / wake_up cycles;
                   requests meeting a sleeping engine must get 503 with the body
    sampler        the RSS of the server's process tree (the API server, the engine
                   core and any workers) and the resident bytes of their VMM
                   reservations (KV cache, weight arena), every few seconds while awake

and at the end a SIGTERM with requests in flight: they must get 503 (streams: an
error event, then [DONE]) and the server must exit 0. Every answer is checked:
`violations` lists any 5xx other than those 503s, any body that is not the OpenAI
shape, any stream without [DONE]. `tracebacks` holds the server log's tracebacks.

Leaks versus first touches: the KV cache is committed with mmap/mprotect, and a
committed page counts in RSS only once written, so RSS rises as requests first use
new blocks (and falls when sleep releases them). The sampler therefore reads
/proc/PID/smaps and subtracts the resident bytes of the VMM reservations (runs of
adjacent anonymous mappings that include a PROT_NONE part and span at least
`_MIN_RESERVATION_BYTES`; glibc's thread heaps, 64 MiB, stay counted): what is
left must stay flat after the first minute.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

# Mappings at least this large that hold a PROT_NONE part are VMM reservations (the
# KV cache, the weight arena); glibc's per-thread heaps reserve 64 MiB each.
_MIN_RESERVATION_BYTES = 128 << 20
_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):$", re.M)

WORDS = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
    "place", "case", "week", "company", "system", "program", "question", "work", "number",
    "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact",
]


@dataclass
class LoadReport:
    """What one mixed-load run saw."""

    statuses: dict[str, int] = field(default_factory=dict)  # "kind status" -> count
    violations: list[str] = field(default_factory=list)
    # {"t", "rss_mib", "vmm_resident_mib", "processes"}, summed over the server's tree
    samples: list[dict] = field(default_factory=list)
    sleep_cycles: int = 0
    shutdown: dict = field(default_factory=dict)
    tracebacks: list[str] = field(default_factory=list)

    def count(self, kind: str, status: int | str) -> None:
        key = f"{kind} {status}"
        self.statuses[key] = self.statuses.get(key, 0) + 1

    def violate(self, kind: str, what: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(f"{kind}: {what}"[:500])

    def leak_figures(self, warmup_s: float = 60.0) -> dict:
        """RSS minus VMM-resident bytes: first and last sample after `warmup_s`, growth."""
        awake = [s for s in self.samples if s["t"] >= warmup_s] or self.samples
        if not awake:
            return {}
        first, last = awake[0], awake[-1]
        rest = [s["rss_mib"] - s["vmm_resident_mib"] for s in awake]
        return {"rss_mib_first": first["rss_mib"], "rss_mib_last": last["rss_mib"],
                "rss_minus_vmm_mib_first": rest[0], "rss_minus_vmm_mib_last": rest[-1],
                "rss_minus_vmm_mib_max": max(rest), "rss_minus_vmm_mib_min": min(rest),
                "rss_minus_vmm_growth_ratio": rest[-1] / rest[0]}


def _mappings(pid: int) -> list[tuple[int, int, str, bool, int]]:
    """(start, end, perms, anonymous, resident bytes) of each mapping in /proc/PID/smaps."""
    out: list[tuple[int, int, str, bool, int]] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        header = _SMAPS_HEADER.match(line)
        if header:
            anonymous = header.group(4) == "0" and not header.group(5)
            out.append((int(header.group(1), 16), int(header.group(2), 16), header.group(3),
                        anonymous, 0))
        elif line.startswith("Rss:") and out:
            start, end, perms, anonymous, _ = out[-1]
            out[-1] = (start, end, perms, anonymous, int(line.split()[1]) * 1024)
    return out


def memory_sample(pid: int) -> tuple[float, float]:
    """(RSS MiB, MiB resident in VMM reservations) of process `pid` (see the module doc)."""
    mappings = _mappings(pid)
    vmm = 0
    run: list[tuple[int, int, str, bool, int]] = []
    for mapping in [*mappings, (0, 0, "", False, 0)]:  # a sentinel closes the last run
        if run and (not mapping[3] or mapping[0] != run[-1][1]):
            reservation = run[-1][1] - run[0][0] >= _MIN_RESERVATION_BYTES
            if reservation and any(m[2].startswith("---") for m in run):
                vmm += sum(m[4] for m in run)
            run = []
        if mapping[3]:
            run.append(mapping)
    return sum(m[4] for m in mappings) / 2**20, vmm / 2**20


def tree_memory_sample(pid: int) -> tuple[float, float, int]:
    """(RSS MiB, VMM-resident MiB, number of processes) summed over process `pid` and all
    its descendants: since the engine core runs in its own process, the API server's own
    smaps hold neither the model nor the KV cache. A process that exits between the listing
    and the read is left out of that sample."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0, 0
    rss = vmm = 0.0
    counted = 0
    for process in processes:
        try:
            one_rss, one_vmm = memory_sample(process.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        rss, vmm, counted = rss + one_rss, vmm + one_vmm, counted + 1
    return rss, vmm, counted


def _is_error_body(body: object, status: int) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    error = body["error"]
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and error["code"] == status and isinstance(error["message"], str))


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


HOSTILE: list[tuple[str, str, object]] = [
    # (method path, description, body: bytes are sent raw, anything else as JSON)
    ("POST /v1/completions", "bad json", b'{"prompt": "x", '),
    ("POST /v1/completions", "not an object", b"[1, 2, 3]"),
    ("POST /v1/completions", "bad utf-8", b'{"prompt": "\xff\xfe"}'),
    ("POST /v1/completions", "lone surrogate", b'{"prompt": "\\ud800"}'),
    ("POST /v1/completions", "huge n", {"prompt": "hi", "n": 10**20}),
    ("POST /v1/completions", "negative max_tokens", {"prompt": "hi", "max_tokens": -5}),
    ("POST /v1/completions", "temperature string", {"prompt": "hi", "temperature": "hot"}),
    ("POST /v1/completions", "empty prompt", {"prompt": ""}),
    ("POST /v1/completions", "prompt too long", {"prompt": "hello " * 5000}),
    ("POST /v1/completions", "2 MB prompt", {"prompt": "a" * (2 << 20), "max_tokens": 1}),
    ("POST /v1/completions", "token id out of range", {"prompt": [10**9]}),
    ("POST /v1/completions", "unknown model", {"model": "gpt-9", "prompt": "hi"}),
    ("POST /v1/completions", "deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("POST /v1/chat/completions", "int text part",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}),
    ("POST /v1/chat/completions", "null text part",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("POST /v1/chat/completions", "image part",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("POST /v1/chat/completions", "no messages", {"messages": []}),
    ("POST /v1/chat/completions", "broken template",
     {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for %}"}),
    ("POST /v1/chat/completions", "sandbox escape",
     {"messages": [{"role": "user", "content": "hi"}],
      "chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}),
    ("POST /tokenize", "template type error",
     {"messages": [{"role": "user", "content": "hi"}],
      "chat_template": "{{ messages[0].content + 1 }}"}),
    ("POST /tokenize", "int text part",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": [1]}]}]}),
    ("POST /detokenize", "bad token", {"tokens": [-1]}),
    ("GET /v1/nothing", "unknown route", None),
    ("DELETE /v1/models", "wrong method", None),
]


class MixedLoad:
    """Run the load against `server` (a `RemoteServer`); see the module doc.

    Args:
        server: the running server (its process is read for memory samples).
        model: the served model name.
        headers: extra headers (an API key).
        max_model_len: the server's context length (for long prompts).
        sleep_period_s: seconds between sleep / wake_up cycles (None: no sleeping;
            the server needs --enable-sleep-mode).
        seed: for the random choices.
    """

    def __init__(self, server, model: str, *, headers: dict[str, str] | None = None,
                 max_model_len: int = 512, sleep_period_s: float | None = 30.0,
                 sample_period_s: float = 5.0, seed: int = 0) -> None:
        self.server = server
        self.model = model
        self.headers = headers or {}
        self.max_model_len = max_model_len
        self.sleep_period_s = sleep_period_s
        self.sample_period_s = sample_period_s
        self.rng = random.Random(seed)
        self.report = LoadReport()
        self._asleep = asyncio.Event()
        self._stop = asyncio.Event()
        self._t0 = 0.0

    # ------------------------------------------------------------------ checks
    def _check_error(self, kind: str, response: httpx.Response, allowed: set[int]) -> None:
        status = response.status_code
        self.report.count(kind, status)
        if status not in allowed:
            self.report.violate(kind, f"status {status}: {response.text[:200]}")
            return
        try:
            body = response.json()
        except ValueError:
            self.report.violate(kind, f"status {status} without a JSON body: {response.text[:200]}")
            return
        if not _is_error_body(body, status):
            self.report.violate(kind, f"status {status} body is not the OpenAI error: {body}")

    def _check_events(self, kind: str, events: list[str]) -> None:
        if not events or events[-1] != "data: [DONE]":
            self.report.violate(kind, f"stream did not end with [DONE]: {events[-2:]}")
            return
        for event in events[:-1]:
            payload = json.loads(event.removeprefix("data: "))
            if "error" in payload:
                code = payload["error"].get("code")
                if code != 503 or not _is_error_body(payload, 503):
                    self.report.violate(kind, f"stream error event: {event[:200]}")
            elif "choices" not in payload:
                self.report.violate(kind, f"stream chunk without choices: {event[:200]}")

    # ----------------------------------------------------------------- clients
    def _generation_body(self) -> tuple[str, dict]:
        rng = self.rng
        max_tokens = rng.choice((4, 8, 16, 32, 64))
        extra = rng.choice(({}, {"n": 2}, {"logprobs": 2}, {"ignore_eos": True}, {"seed": 7}))
        if rng.random() < 0.5:
            body = {"prompt": _prompt(rng, rng.randrange(3, 60)), "max_tokens": max_tokens}
            return "/v1/completions", {**body, **extra, "model": self.model}
        if "logprobs" in extra:
            extra = {"logprobs": True, "top_logprobs": 2}
        messages = [{"role": "user", "content": _prompt(rng, rng.randrange(3, 40))}]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                        **extra, "model": self.model}

    async def _stream(self, client: httpx.AsyncClient, kind: str, path: str, body: dict,
                      leave_after: int | None = None) -> None:
        async with client.stream("POST", self.server.url_for(path), json={**body, "stream": True},
                                 headers=self.headers) as response:
            if response.status_code != 200:
                await response.aread()
                self._check_error(kind, response, {503})
                return
            self.report.count(kind, 200)
            events: list[str] = []
            async for line in response.aiter_lines():
                if line:
                    events.append(line)
                    if leave_after is not None and len(events) >= leave_after:
                        return  # the client leaves: closing the response aborts the request
        self._check_events(kind, events)

    async def _plain(self, client: httpx.AsyncClient, kind: str, path: str, body: dict) -> None:
        response = await client.post(self.server.url_for(path), json=body, headers=self.headers)
        if response.status_code == 200:
            self.report.count(kind, 200)
            if "choices" not in response.json():
                self.report.violate(kind, f"200 without choices: {response.text[:200]}")
        else:
            self._check_error(kind, response, {503})

    async def _streamer(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            path, body = self._generation_body()
            await self._guard("stream", self._stream(client, "stream", path, body))

    async def _leaver(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            path, body = self._generation_body()
            body["max_tokens"] = 200
            if self.rng.random() < 0.5:
                leave = self.rng.randrange(1, 6)
                await self._guard("leave", self._stream(client, "leave", path, body, leave))
            else:
                task = asyncio.ensure_future(self._plain(client, "leave-plain", path, body))
                await asyncio.sleep(self.rng.uniform(0.05, 1.5))
                task.cancel()  # the client gives up: its connection closes
                await asyncio.gather(task, return_exceptions=True)

    async def _hostile(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            route, what, body = self.rng.choice(HOSTILE)
            method, path = route.split(" ", 1)
            kind = f"hostile[{what}]"
            kwargs: dict = {"headers": {**self.headers, "content-type": "application/json"}}
            if isinstance(body, bytes):
                kwargs["content"] = body
            elif body is not None:
                kwargs["content"] = json.dumps({"model": self.model, **body})
            try:
                response = await client.request(method, self.server.url_for(path), **kwargs)
            except httpx.HTTPError as e:
                self.report.violate(kind, f"transport error {e!r}")
                continue
            self._check_error(kind, response, {400, 404, 405, 413, 503})
            await asyncio.sleep(0.05)

    async def _long(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            words = int(self.max_model_len * 0.6)
            body = {"model": self.model, "prompt": _prompt(self.rng, words), "max_tokens": 8}
            await self._guard("long", self._plain(client, "long", "/v1/completions", body))

    async def _sleeper(self, client: httpx.AsyncClient) -> None:
        if self.sleep_period_s is None:
            return
        cycle = 0
        while not self._stop.is_set():
            if await self._wait_stop(self.sleep_period_s):
                return
            cycle += 1
            level = 2 if cycle % 3 == 0 else 1
            self._asleep.set()
            slept = await client.post(self.server.url_for("sleep"), params={"level": level},
                                      timeout=300)
            await asyncio.sleep(1.0)
            woke = await client.post(self.server.url_for("wake_up"), timeout=600)
            self._asleep.clear()
            for kind, response in (("sleep", slept), ("wake_up", woke)):
                self.report.count(kind, response.status_code)
                if response.status_code != 200:
                    self.report.violate(kind, f"status {response.status_code}: {response.text}")
            self.report.sleep_cycles += 1

    async def _sampler(self) -> None:
        while not self._stop.is_set():
            if not self._asleep.is_set():
                rss, vmm, processes = tree_memory_sample(self.server.proc.pid)
                self.report.samples.append({"t": round(time.monotonic() - self._t0, 1),
                                            "rss_mib": round(rss, 1),
                                            "vmm_resident_mib": round(vmm, 1),
                                            "processes": processes})
            if await self._wait_stop(self.sample_period_s):
                return

    async def _guard(self, kind: str, coro) -> None:
        try:
            await coro
        except httpx.HTTPError as e:
            self.report.violate(kind, f"transport error {e!r}")
        if self._asleep.is_set():  # the engine answers 503 at once: do not spin on it
            await asyncio.sleep(0.25)

    async def _wait_stop(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            return False
        return True

    # --------------------------------------------------------------------- run
    async def run(self, duration_s: float, streamers: int = 6, leavers: int = 2,
                  hostile: int = 2, long: int = 1) -> LoadReport:
        """Load for `duration_s`, then stop the clients; the server keeps running."""
        self._t0 = time.monotonic()
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            workers = [*(self._streamer(client) for _ in range(streamers)),
                       *(self._leaver(client) for _ in range(leavers)),
                       *(self._hostile(client) for _ in range(hostile)),
                       *(self._long(client) for _ in range(long)),
                       self._sleeper(client), self._sampler()]
            tasks = [asyncio.ensure_future(w) for w in workers]
            await asyncio.sleep(duration_s)
            self._stop.set()
            await asyncio.gather(*tasks)
        return self.report

    async def sigterm_with_requests_in_flight(self, in_flight: int = 4) -> dict:
        """SIGTERM while `in_flight` long requests run; every one must end with a 503."""
        body = {"model": self.model, "prompt": "Once upon a time", "ignore_eos": True,
                "max_tokens": self.max_model_len - 16}
        async with httpx.AsyncClient(timeout=600) as client:
            tasks = []
            for i in range(in_flight):
                if i % 2:
                    coro = self._stream(client, "sigterm-stream", "/v1/completions", body)
                else:
                    coro = self._plain(client, "sigterm-plain", "/v1/completions", body)
                tasks.append(asyncio.ensure_future(self._guard("sigterm", coro)))
            await asyncio.sleep(2.0)
            start = time.monotonic()
            returncode = await asyncio.to_thread(self.server.terminate, 120)
            await asyncio.gather(*tasks)
            exit_s = time.monotonic() - start
        self.report.shutdown = {"returncode": returncode, "exit_s": round(exit_s, 2)}
        if returncode != 0:
            self.report.violate("sigterm", f"exit code {returncode}")
        return self.report.shutdown

    def collect_tracebacks(self) -> list[str]:
        """Tracebacks in the server's log (each with its next 5 lines)."""
        log = self.server.log()
        self.report.tracebacks = ["\n".join(log[m.start():].splitlines()[:6])
                                  for m in _TRACEBACK.finditer(log)]
        return self.report.tracebacks
