"""A prefill/decode disaggregation proxy over several prefill and several decode instances.

    client --POST /v1/completions | /v1/chat/completions--> proxy
      0. pick a decode instance and then a prefill instance (--policy: least_loaded, the
         fewest requests this proxy has in flight there, ties round-robin; or round_robin)
      1. prefill instance (kv_producer): the same body with max_tokens=1, stream off,
         kv_transfer_params={"do_remote_decode": true}; its response's
         kv_transfer_params say where the prompt's KV blocks wait
      2. decode instance (kv_consumer): the original body plus those
         kv_transfer_params; it reads the blocks over NIXL and generates.
         Its response (JSON or the SSE stream) goes back to the client as is.

Run (see docs/kv_connectors.md), here 1P2D:

    python -m vllm.entrypoints.disagg_proxy --port 8000 --policy least_loaded \\
        --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 http://127.0.0.1:8201

Health: an instance that fails a request at the transport level (connection refused,
connect timeout, a read error or disconnect mid-request) leaves rotation; a background
task sends `GET /health` to each instance out of rotation every `probe_interval_s`
(2 s) and a 200 puts it back. `GET /instances` shows url, role, healthy and in_flight
of each. `GET /health` of the proxy probes every instance at once (each within
PROBE_TIMEOUT_S; the answers move instances out of or back into rotation) and is 200
while at least one prefill and one decode instance answer theirs, else 503 with an
OpenAI error body naming those that did not (a load balancer then stops sending).

Logs as `vllm serve` does: one line with its instances, "... listening on URL" once the
port is bound (a port that cannot be bound is one line, exit 2), and uvicorn's access
log, one line per request (`--disable-uvicorn-access-log`, `--uvicorn-log-level`).

Errors: an instance's own error body and status pass through (a 5xx answer is an
answer: the instance stays in rotation). A transport failure gives the client a 502
with an OpenAI error body naming the instance; a prefill or decode instance that could
not even be connected to (nothing reached it) is retried once on another of its role.
A decode that failed after that is not: the prefill's blocks are readable once. With
every instance of a role out of rotation the answer is a 503 naming them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.logger import init_logger

# Named, not __name__: run with `python -m` this module is __main__, whose logger is outside
# "vllm" and so has no handler (its info lines, rotation changes included, would be lost).
logger = init_logger("vllm.entrypoints.disagg_proxy")

TIMEOUT_S = 600.0  # a long generation on a slow decode instance is still an answer
PROBE_TIMEOUT_S = 5.0  # a /health that takes longer counts as not healthy (one probe round)
POLICIES = ("least_loaded", "round_robin")
# Transport errors before any byte reached the instance: another instance may take it.
UNSENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
_ERROR_TYPES = {400: "BadRequestError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}


class _ProxyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": _ERROR_TYPES[self.status],
                                       "param": None, "code": self.status}},
                            status_code=self.status)


@dataclass(eq=False)
class Instance:
    """One vLLM instance behind the proxy, as the proxy sees it."""

    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = True
    in_flight: int = 0  # requests of this proxy sent to it and not yet fully answered

    def as_json(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "in_flight": self.in_flight}


class InstancePool:
    """The instances of one role: which one takes the next request, the requests in flight
    on each, and which are out of rotation after a transport failure.

    Not thread-safe: the proxy's one event loop calls it, and no method awaits.
    """

    def __init__(self, role: str, urls: list[str], policy: str) -> None:
        """Raises ValueError for an empty `urls` or a `policy` not in POLICIES."""
        if not urls:
            raise ValueError(f"no {role} instance URL given")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.role, self.policy = role, policy
        self.instances = [Instance(url, role) for url in urls]
        self._next = 0  # where the round-robin order starts for the next pick

    def acquire(self) -> Instance:
        """The instance for the next request, its in_flight already counted; release() it.

        Raises _ProxyError(503) when every instance is out of rotation.
        """
        order = self.instances[self._next:] + self.instances[:self._next]
        healthy = [i for i in order if i.healthy]
        if not healthy:
            urls = ", ".join(i.url for i in self.instances)
            raise _ProxyError(503, f"no {self.role} instance is available: all of {urls} "
                                   "are out of rotation after failing (re-probed via /health)")
        # min() keeps the first of equals, so ties go to the next one in round-robin order.
        chosen = healthy[0] if self.policy == "round_robin" else min(
            healthy, key=lambda i: i.in_flight)
        self._next = (self.instances.index(chosen) + 1) % len(self.instances)
        chosen.in_flight += 1
        return chosen

    def release(self, instance: Instance) -> None:
        instance.in_flight -= 1

    @contextmanager
    def lease(self) -> Iterator[Instance]:
        """acquire() for the duration of a with-block. Raises _ProxyError(503) as acquire()."""
        instance = self.acquire()
        try:
            yield instance
        finally:
            self.release(instance)

    def fail(self, instance: Instance, error: Exception) -> None:
        """Take `instance` out of rotation after a transport error (logged once)."""
        if instance.healthy:
            instance.healthy = False
            logger.warning("%s instance %s left rotation: %r", self.role, instance.url, error)

    def rejoin(self, instance: Instance) -> None:
        if not instance.healthy:
            instance.healthy = True
            logger.info("%s instance %s rejoined rotation (GET /health is 200)", self.role,
                        instance.url)

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances)

    def down(self) -> list[str]:
        """URLs of the instances out of rotation."""
        return [i.url for i in self.instances if not i.healthy]


def build_app(prefill_urls: list[str], decode_urls: list[str], policy: str = "least_loaded",
              probe_interval_s: float = 2.0, url: str | None = None) -> FastAPI:
    """The proxy app: prefill on one instance, decode on another, per request.

    `policy` is one of POLICIES; `probe_interval_s` (seconds) is how often instances out of
    rotation are probed; `url`, where it listens, is logged once it starts. Raises
    ValueError for an empty URL list or an unknown policy.
    """
    prefills = InstancePool("prefill", prefill_urls, policy)
    decodes = InstancePool("decode", decode_urls, policy)
    client: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # No cap on connections: httpx's default (100) would queue requests past it and
        # time them out as PoolTimeout, a transport error that would evict a healthy instance.
        client["c"] = httpx.AsyncClient(timeout=TIMEOUT_S,
                                        limits=httpx.Limits(max_connections=None))
        probe = asyncio.create_task(_probe_forever(client["c"], (prefills, decodes),
                                                   probe_interval_s))
        if url is not None:
            logger.info("Disaggregation proxy is listening on %s", url)
        yield
        probe.cancel()
        await client["c"].aclose()

    app = FastAPI(lifespan=lifespan)

    async def handle(request: Request, path: str) -> Response:
        try:
            return await _complete(client["c"], prefills, decodes, path, await _json_body(request))
        except _ProxyError as e:
            return e.response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        return await _health(client["c"], (prefills, decodes))

    @app.get("/instances")
    async def instances() -> JSONResponse:
        return JSONResponse({"policy": policy, "instances": [
            i.as_json() for pool in (prefills, decodes) for i in pool.instances]})

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            return await _models(client["c"], decodes)
        except _ProxyError as e:
            return e.response()

    return app


async def _complete(client: httpx.AsyncClient, prefills: InstancePool, decodes: InstancePool,
                    path: str, body: dict) -> Response:
    """One completion: prefill on one instance, decode on another.

    Raises _ProxyError: 503 when a role has no instance in rotation, 502 when an instance
    fails, _Passthrough for an instance's own error answer.
    """
    # The decode is chosen first: no prefill runs (and holds its KV blocks until its
    # abort timeout) for a request no decode instance can take.
    decode = decodes.acquire()
    relayed = False  # a stream's relay releases the decode itself, when the stream ends
    try:
        params = await _prefill(client, prefills, path, body)
        decode_body = dict(body, kv_transfer_params=params)
        try:
            response = await _decode(client, decodes, decode, path, decode_body)
        except _Unsent as e:  # nothing reached it: another decode instance may read the KV
            if not decodes.any_healthy():
                raise _ProxyError(502, e.message) from e
            logger.info("retrying a decode that %s refused on another instance", decode.url)
            decodes.release(decode)
            decode = decodes.acquire()
            response = await _decode(client, decodes, decode, path, decode_body)
        relayed = isinstance(response, _RelayResponse)
        return response
    finally:
        if not relayed:
            decodes.release(decode)


async def _models(client: httpx.AsyncClient, decodes: InstancePool) -> Response:
    """A decode instance's /v1/models. Raises _ProxyError (503 none in rotation, 502 failed)."""
    with decodes.lease() as decode:
        try:
            r = await client.get(f"{decode.url}/v1/models")
        except httpx.TransportError as e:
            decodes.fail(decode, e)
            raise _ProxyError(502, f"the decode instance {decode.url} is unreachable: "
                                   f"{e!r}") from e
    return Response(r.content, status_code=r.status_code, media_type="application/json")


async def _json_body(request: Request) -> dict:
    """The request's JSON object. Raises _ProxyError(400) for anything else."""
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
    except ValueError as e:
        raise _ProxyError(400, f"invalid JSON body: {e}") from e
    return body


async def _prefill(client: httpx.AsyncClient, prefills: InstancePool, path: str,
                   body: dict) -> dict:
    """Run the prompt on a prefill instance; returns its kv_transfer_params.

    Raises _ProxyError: 503 with no prefill instance in rotation, 502 when the instance
    fails (after one retry elsewhere if it could not be connected to), _Passthrough for
    its own error answer.
    """
    prefill_body = dict(body, max_tokens=1, stream=False,
                        kv_transfer_params={"do_remote_decode": True})
    prefill_body.pop("stream_options", None)
    if "max_completion_tokens" in prefill_body:
        prefill_body["max_completion_tokens"] = 1
    for attempt in (1, 2):
        with prefills.lease() as prefill:
            try:
                r = await client.post(f"{prefill.url}{path}", json=prefill_body)
                break
            except httpx.TransportError as e:
                prefills.fail(prefill, e)
                # A connect error means no byte reached the instance: another may take it.
                unsent = isinstance(e, UNSENT_ERRORS)
                if not (unsent and attempt == 1 and prefills.any_healthy()):
                    raise _ProxyError(502, f"the prefill instance {prefill.url} failed: "
                                           f"{e!r}") from e
                logger.info("retrying a prefill that %s refused on another instance",
                            prefill.url)
    if r.status_code != 200:
        raise _Passthrough(r)
    params = r.json().get("kv_transfer_params")
    if not params:
        raise _ProxyError(502, f"the prefill instance {prefill.url} returned no "
                               "kv_transfer_params (is it started with a kv_producer "
                               "--kv-transfer-config?)")
    return params


async def _decode(client: httpx.AsyncClient, decodes: InstancePool, decode: Instance,
                  path: str, body: dict) -> Response:
    """Generate on `decode` (already acquired). A 200 stream comes back as a _RelayResponse,
    which releases `decode` when the stream ends; the caller releases it otherwise.

    Raises _ProxyError(502) when the instance fails (it leaves rotation): _Unsent when it
    could not be connected to (no byte reached it).
    """
    stream = bool(body.get("stream"))
    req = client.build_request("POST", f"{decode.url}{path}", json=body)
    try:
        r = await client.send(req, stream=stream)
        if stream and r.status_code != 200:
            await r.aread()  # an error body, passed through whole below
    except httpx.TransportError as e:
        decodes.fail(decode, e)
        kind = _Unsent if isinstance(e, UNSENT_ERRORS) else _ProxyError
        raise kind(502, f"the decode instance {decode.url} failed: {e!r}") from e
    if stream and r.status_code == 200:
        return _RelayResponse(r, decodes, decode)
    return Response(r.content, status_code=r.status_code, media_type="application/json")


class _Unsent(_ProxyError):
    """A decode instance could not be connected to: the request may go to another."""


class _RelayResponse(StreamingResponse):
    """A decode instance's SSE stream relayed to the client; the decode's in-flight count
    ends when the stream does: fully relayed, failed, or the client gone.

    Why not a plain StreamingResponse with a `finally` in the generator: when the client
    disconnects while the relay waits in `send`, Starlette leaves the generator suspended
    (its `finally` would run at garbage collection), and a generator that never started
    runs no `finally` at all.
    """

    def __init__(self, upstream: httpx.Response, decodes: InstancePool, decode: Instance) -> None:
        super().__init__(_relay(upstream, decodes, decode), media_type="text/event-stream")
        self._upstream, self._decodes, self._decode = upstream, decodes, decode

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
                await self._upstream.aclose()
            finally:
                self._decodes.release(self._decode)


async def _relay(r: httpx.Response, decodes: InstancePool, decode: Instance
                 ) -> AsyncIterator[bytes]:
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.TransportError as e:  # the decode instance died mid-stream: say so in the stream
        decodes.fail(decode, e)
        error = {"error": {"message": f"the decode instance {decode.url} failed: {e!r}",
                           "type": "BadGatewayError", "param": None, "code": 502}}
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        await r.aclose()


async def _health(client: httpx.AsyncClient, pools: tuple[InstancePool, ...]) -> Response:
    """Probe every instance now: 200 while each role has a healthy one, else 503."""
    await asyncio.gather(*(_probe(client, pool, instance, evict=True)
                           for pool in pools for instance in pool.instances))
    if all(pool.any_healthy() for pool in pools):
        return Response(status_code=200)
    down = ", ".join(f"{pool.role} {pool.down()}" for pool in pools if pool.down())
    return _ProxyError(503, f"no healthy instance of every role: down are {down}").response()


async def _probe_forever(client: httpx.AsyncClient, pools: tuple[InstancePool, ...],
                         interval_s: float) -> None:
    """Every `interval_s` seconds, GET /health of each instance out of rotation (all at
    once, each within PROBE_TIMEOUT_S); a 200 puts it back."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.gather(*(_probe(client, pool, instance) for pool in pools
                               for instance in pool.instances if not instance.healthy))


async def _probe(client: httpx.AsyncClient, pool: InstancePool, instance: Instance,
                 evict: bool = False) -> None:
    """GET the instance's /health: a 200 puts it back into rotation; with `evict`, no
    answer or another status takes it out."""
    try:
        r = await client.get(f"{instance.url}/health", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as e:
        if evict:
            pool.fail(instance, e)
        return
    if r.status_code == 200:
        pool.rejoin(instance)
    elif evict:
        pool.fail(instance, RuntimeError(f"GET /health answered {r.status_code}"))


class _Passthrough(_ProxyError):
    """An instance answered with an error: the client gets that answer unchanged."""

    def __init__(self, r: httpx.Response) -> None:
        super().__init__(r.status_code, r.text)
        self._r = r

    def response(self) -> Response:
        return Response(self._r.content, status_code=self._r.status_code,
                        media_type="application/json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill (kv_producer) instances, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode (kv_consumer) instances, e.g. http://127.0.0.1:8200")
    parser.add_argument("--policy", choices=POLICIES, default="least_loaded",
                        help="least_loaded: the instance with the fewest requests this proxy "
                             "has in flight on it, ties round-robin (default); round_robin")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="log level of uvicorn, the HTTP server (default: info)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="do not log one line per request (default: log them)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the proxy until SIGINT/SIGTERM; returns the exit code (2: the port is taken)."""
    import sys

    from vllm.entrypoints.openai.cli_args import bind_socket

    args = parse_args(argv)
    prefill_urls = [u.rstrip("/") for u in args.prefill]
    decode_urls = [u.rstrip("/") for u in args.decode]
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"disagg_proxy: error: {e.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    app = build_app(prefill_urls, decode_urls, policy=args.policy,
                    url=f"http://{args.host}:{port}")
    logger.info("Disaggregation proxy (%s): prefill %s, decode %s", args.policy,
                prefill_urls, decode_urls)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again with
    # the handlers it found: these make that a clean exit 0 (as `vllm serve`), not 143.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
