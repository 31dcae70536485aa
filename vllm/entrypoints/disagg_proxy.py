"""A prefill/decode disaggregation proxy (1P1D, or several of each round-robin).

    client --POST /v1/completions | /v1/chat/completions--> proxy
      1. prefill instance (kv_producer): the same body with max_tokens=1, stream off,
         kv_transfer_params={"do_remote_decode": true}; its response's
         kv_transfer_params say where the prompt's KV blocks wait
      2. decode instance (kv_consumer): the original body plus those
         kv_transfer_params; it reads the blocks over NIXL and generates.
         Its response (JSON or the SSE stream) goes back to the client as is.

Run (see docs/kv_connectors.md):

    python -m vllm.entrypoints.disagg_proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Errors: an instance's own error body and status pass through; an instance
that cannot be reached (or dies mid-request) gives a 502 with an OpenAI error
body naming it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.logger import init_logger

logger = init_logger(__name__)

TIMEOUT_S = 600.0  # a long generation on a slow decode instance is still an answer


class _ProxyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        kind = "BadGatewayError" if self.status == 502 else "BadRequestError"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": None,
                                       "code": self.status}}, status_code=self.status)


def build_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    """The proxy app: prefill on one instance, decode on another, per request."""
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client["c"] = httpx.AsyncClient(timeout=TIMEOUT_S)
        yield
        await client["c"].aclose()

    app = FastAPI(lifespan=lifespan)

    async def handle(request: Request, path: str) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as e:
            return _ProxyError(400, f"invalid JSON body: {e}").response()
        try:
            params = await _prefill(client["c"], next(prefills), path, body)
            decode_body = dict(body, kv_transfer_params=params)
            return await _decode(client["c"], next(decodes), path, decode_body)
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
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        url = decode_urls[0]
        try:
            r = await client["c"].get(f"{url}/v1/models")
        except httpx.HTTPError as e:
            return _ProxyError(502, f"the decode instance {url} is unreachable: {e!r}").response()
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    return app


async def _prefill(client: httpx.AsyncClient, url: str, path: str, body: dict) -> dict:
    """Run the prompt on a prefill instance; returns its kv_transfer_params."""
    prefill_body = dict(body, max_tokens=1, stream=False,
                        kv_transfer_params={"do_remote_decode": True})
    prefill_body.pop("stream_options", None)
    if "max_completion_tokens" in prefill_body:
        prefill_body["max_completion_tokens"] = 1
    try:
        r = await client.post(f"{url}{path}", json=prefill_body)
    except httpx.HTTPError as e:
        raise _ProxyError(502, f"the prefill instance {url} failed: {e!r}") from e
    if r.status_code != 200:
        raise _Passthrough(r)
    params = r.json().get("kv_transfer_params")
    if not params:
        raise _ProxyError(502, f"the prefill instance {url} returned no kv_transfer_params "
                               "(is it started with a kv_producer --kv-transfer-config?)")
    return params


async def _decode(client: httpx.AsyncClient, url: str, path: str, body: dict) -> Response:
    if not body.get("stream"):
        try:
            r = await client.post(f"{url}{path}", json=body)
        except httpx.HTTPError as e:
            raise _ProxyError(502, f"the decode instance {url} failed: {e!r}") from e
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    req = client.build_request("POST", f"{url}{path}", json=body)
    try:
        r = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise _ProxyError(502, f"the decode instance {url} failed: {e!r}") from e
    if r.status_code != 200:
        content = await r.aread()
        await r.aclose()
        return Response(content, status_code=r.status_code, media_type="application/json")
    return StreamingResponse(_relay(r, url), media_type="text/event-stream")


async def _relay(r: httpx.Response, url: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:  # the decode instance died mid-stream: say so in the stream
        error = {"error": {"message": f"the decode instance {url} failed: {e!r}",
                           "type": "BadGatewayError", "param": None, "code": 502}}
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        await r.aclose()


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    logger.info("disaggregation proxy: prefill %s, decode %s", args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
