"""The OpenAI-compatible HTTP server: FastAPI app over an `AsyncLLM`, run by uvicorn.

```
vllm serve ... -> (cli) check flags, bind the port: before torch is imported, so both fail fast
             -> run_server(args, config, sock): build AsyncLLM (load model, size KV cache),
                  build_app(engine, args), uvicorn until SIGINT/SIGTERM
build_app:  /v1/models  /v1/completions  /v1/chat/completions          (API key if set)
            /health  /version  /metrics  /tokenize  /detokenize
            /sleep  /wake_up  /is_sleeping                              (--enable-sleep-mode)
            /kv_cache/limit                                      (--enable-elastic-kv-cache)
```

Shutdown: the first SIGINT/SIGTERM stops accepting connections, lets
in-flight requests finish for up to `--shutdown-timeout` seconds, then shuts
the engine down (device memory returned), which fails the requests still
running: 503 with the OpenAI error body, or an SSE error event and `[DONE]`
on a stream. The process exits 0; a second signal forces it. When the
engine dies, /health answers 503 and the process exits 1 after
`_DEAD_ENGINE_EXIT_DELAY_S`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import signal
import socket
import threading
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.engine.arg_utils import human_readable_bytes
from vllm.entrypoints.openai.cli_args import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    bind_socket,
    load_chat_template,
    parse_chat_template_kwargs,
)
from vllm.entrypoints.openai.errors import APIError, error_from_exception
from vllm.entrypoints.openai.metrics import (
    CONTENT_TYPE_LATEST,
    PrometheusStatLogger,
    cache_config_info,
)
from vllm.entrypoints.openai.protocol import (
    INVALID_UNICODE_ERROR,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import cancel_on_disconnect
from vllm.entrypoints.openai.serving_models import ServedModels
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.logger import init_logger
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, startup_errors
from vllm.version import __version__

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Seconds the requests failed at the end of --shutdown-timeout get to send their
# error responses before uvicorn cancels what is left (a backstop: failed handlers
# return within milliseconds).
_SHUTDOWN_FLUSH_S = 5.0
# Seconds between the engine's death and the process exit: the failed requests'
# 500s are flushed and a /health probe can see the 503.
_DEAD_ENGINE_EXIT_DELAY_S = 1.0


# ------------------------------------------------------------------------------ app
def build_app(engine_client: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app over `engine_client` (which it feeds a Prometheus logger).

    `args` is the `vllm serve` namespace; read here: served_model_name, model,
    api_key, chat_template, default_chat_template_kwargs, reasoning_parser,
    tool_call_parser, enable_auto_tool_choice, return_tokens_as_token_ids (all optional).
    """
    # --served-model-name's names; unset, the engine's (the MODEL argument, else the
    # bundled model's name: EngineArgs).
    names = list(getattr(args, "served_model_name", None) or
                 [engine_client.model_config.served_model_name])
    models = ServedModels(names, root=engine_client.model_config.model,
                          max_model_len=engine_client.max_model_len)
    metrics = PrometheusStatLogger(
        models.default_name, max_model_len=engine_client.max_model_len,
        cache_config_info=cache_config_info(engine_client.vllm_config.cache_config,
                                            engine_client.plan))
    engine_client.add_stat_logger(metrics)
    chat_template = load_chat_template(getattr(args, "chat_template", None))

    app = FastAPI(title="vLLM OpenAI-compatible API", version=__version__,
                  root_path=getattr(args, "root_path", None) or "")
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    app.state.models = models
    _install_error_handlers(app)
    api_key = getattr(args, "api_key", None)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    _add_openai_routes(app, engine_client, models, chat_template, args)
    _add_server_routes(app, engine_client, metrics)
    if engine_client.vllm_config.cache_config.enable_sleep_mode:
        _add_sleep_routes(app, engine_client)
    if engine_client.vllm_config.cache_config.enable_elastic_kv_cache:
        _add_elastic_routes(app, engine_client)
    return app


def _add_openai_routes(
    app: FastAPI, engine_client: AsyncLLM, models: ServedModels, chat_template: str | None,
    args: argparse.Namespace,
) -> None:
    as_ids = bool(getattr(args, "return_tokens_as_token_ids", False))
    completion = OpenAIServingCompletion(engine_client, models,
                                         return_tokens_as_token_ids=as_ids)
    template_kwargs = parse_chat_template_kwargs(
        getattr(args, "default_chat_template_kwargs", None))
    chat = OpenAIServingChat(engine_client, models, chat_template,
                             default_chat_template_kwargs=template_kwargs,
                             reasoning_parser=getattr(args, "reasoning_parser", None),
                             tool_parser=getattr(args, "tool_call_parser", None),
                             enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
                             return_tokens_as_token_ids=as_ids)
    if chat.tool_parser_cls is not None and not chat.enable_auto_tools:
        logger.warning("--tool-call-parser %s reads nothing without --enable-auto-tool-choice: "
                       "tool_choice 'auto' is refused", args.tool_call_parser)
    if chat.default_sampling_params:
        logger.info("Using default sampling params from the model's generation config (a "
                    "request's own values override them; --generation-config vllm drops "
                    "them): %s", chat.default_sampling_params)
    tokenization = OpenAIServingTokenization(engine_client, models, chat_template,
                                             template_kwargs)

    @app.get("/v1/models")
    async def show_models() -> JSONResponse:
        return JSONResponse(models.model_list().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await cancel_on_disconnect(raw_request, completion.create_completion(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await cancel_on_disconnect(raw_request, chat.create_chat_completion(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(request)).model_dump())


def _add_server_routes(
    app: FastAPI, engine_client: AsyncLLM, metrics: PrometheusStatLogger
) -> None:
    @app.get("/health")
    async def health() -> Response:
        try:
            await engine_client.check_health()
        except EngineDeadError as e:
            return APIError(503, str(e)).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_sleep_routes(app: FastAPI, engine_client: AsyncLLM) -> None:
    @app.post("/sleep")
    async def sleep(request: Request, level: int = 1) -> Response:
        await _query_only(request, "POST /sleep", "level", "?level=2")
        try:
            await engine_client.sleep(level)
        except Exception as e:
            raise error_from_exception(e, "level") from e
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request,
                      tags: list[str] | None = Query(default=None)) -> Response:
        await _query_only(request, "POST /wake_up", "tags", "?tags=weights", repeats=True)
        try:
            await engine_client.wake_up(tags)
        except Exception as e:
            raise error_from_exception(e, "tags") from e
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        try:
            return JSONResponse({"is_sleeping": await engine_client.is_sleeping()})
        except Exception as e:
            raise error_from_exception(e) from e


async def _query_only(request: Request, route: str, name: str, example: str,
                      repeats: bool = False) -> None:
    """A control route takes its one parameter, `name`, in the query string: a request
    body or any other query parameter is a 400 naming it, never ignored (`/sleep`
    with `{"level": 2}` or `?levle=2` slept at level 1, `/wake_up?tag=weights` woke all).

    Raises:
        APIError: 400 with the parameter the client sent.
    """
    if (await request.body()).strip():
        raise APIError(400, f"{route} takes {name} in the query string ({example}), not in "
                       "a body", param=name)
    for key in request.query_params:
        if key != name or (not repeats and len(request.query_params.getlist(key)) > 1):
            raise APIError(400, f"{key}: {route} takes one query parameter, {name} "
                           f"({example})", param=key)


def _add_elastic_routes(app: FastAPI, engine_client: AsyncLLM) -> None:
    # Like /sleep (which exists only with --enable-sleep-mode), a control
    # endpoint that exists only when its feature flag is on: an operator
    # lowers an engine's share of the device at runtime without a restart.
    @app.post("/kv_cache/limit")
    async def kv_cache_limit(request: Request, limit_bytes: str | None = None) -> JSONResponse:
        """`?limit_bytes=8GiB` caps the elastic KV cache; no value restores the start-up limit."""
        # A misspelt name would restore the start-up limit.
        await _query_only(request, "POST /kv_cache/limit", "limit_bytes", "?limit_bytes=8GiB")
        try:
            value = None if limit_bytes is None else human_readable_bytes(limit_bytes)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            # human_readable_bytes is the --kv-cache-memory-bytes parser: its
            # errors are argparse's, which are not ValueErrors.
            raise APIError(400, f"limit_bytes: {e}", param="limit_bytes") from e
        try:
            return JSONResponse(await engine_client.set_kv_cache_limit(value))
        except Exception as e:
            raise error_from_exception(e, "limit_bytes") from e


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response(headers=exc.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Wrong types and malformed JSON: 400 with the first problem and its field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == INVALID_UNICODE_ERROR:  # a lone surrogate; ctx names the field
        ctx = first.get("ctx") or {}
        return APIError(400, str(ctx.get("message", first.get("msg"))), ctx.get("field"))
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    if tuple(first.get("loc", ())) == ("body",):  # the body as a whole
        if first.get("type") == "missing":
            return APIError(400, "the request body is missing: send a JSON object")
        return APIError(400, "the request body must be a JSON object with Content-Type "
                        f"application/json ({first.get('msg')})")
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query")]
    # A union type reports the member it tried ("str", "list[str]"): keep the field path.
    fields = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    param = ".".join(fields) if fields else None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, f"{where}{first.get('msg')}{more}", param)


class _APIKeyMiddleware:
    """401 with the OpenAI error body unless /v1/* requests carry `Bearer <api key>`.

    A plain ASGI middleware (not BaseHTTPMiddleware), so streaming responses
    and client-disconnect detection pass through untouched.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope["path"].startswith("/v1")):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if header else
                   "Missing API key: send it as 'Authorization: Bearer <key>'.")
        response = APIError(401, message).response(headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


# ------------------------------------------------------------------------------ serve
class _Server(uvicorn.Server):
    """uvicorn.Server with vLLM's shutdown: drain, then fail what is left, then exit 0.

    On the first SIGINT/SIGTERM it stops accepting connections and gives
    in-flight requests `shutdown_timeout` seconds to finish. Then it shuts the
    engine down, which fails every request still running with
    `EngineShutdownError`: a non-streaming client gets HTTP 503 with the OpenAI
    error body, a streaming one a final SSE error event and `data: [DONE]`. The
    handlers return on their own, so nothing is cancelled (no CancelledError
    traceback) and uvicorn's own deadline (`_SHUTDOWN_FLUSH_S` later) is only
    a backstop. A second signal forces the exit.

    uvicorn re-raises a captured signal after its graceful shutdown, which
    would end the process by that signal (exit status 143 for SIGTERM); a
    clean shutdown here returns instead, with `exit_code` 0 (1 if the engine died).
    """

    def __init__(self, config: uvicorn.Config, url: str, engine: AsyncLLM,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.url = url
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        logger.info("Received %s; shutting down: no new connections, in-flight requests get "
                    "up to %g s (--shutdown-timeout)", signal.Signals(sig).name,
                    self.shutdown_timeout)
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            logger.info("vLLM API server is listening on %s", self.url)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.ensure_future(self._fail_in_flight_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets=sockets)
        finally:
            deadline.cancel()

    async def _fail_in_flight_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        running = len(self.server_state.tasks)
        if running:
            logger.info("Shutdown timeout (%g s) is over: failing %d in-flight request(s) "
                        "with 503", delay, running)
        await asyncio.to_thread(self.engine.shutdown)

    def exit_after_engine_death(self, error: EngineDeadError) -> None:
        """Dead-engine callback (any thread): exit 1 after a short delay."""
        logger.error("%s; the server exits in %.1f s", error, _DEAD_ENGINE_EXIT_DELAY_S)
        self.exit_code = 1
        timer = threading.Timer(_DEAD_ENGINE_EXIT_DELAY_S, setattr, (self, "should_exit", True))
        timer.daemon = True
        timer.start()


def non_default_args(args: argparse.Namespace) -> dict:
    """The `vllm serve` arguments that differ from their defaults (API key redacted)."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    defaults = vars(make_arg_parser(argparse.ArgumentParser()).parse_args([]))
    changed = {k: v for k, v in vars(args).items()
               if k in defaults and k != "model_tag" and v != defaults[k]}
    if changed.get("api_key"):
        changed["api_key"] = "<redacted>"
    return changed


def build_engine_config(args: argparse.Namespace) -> VllmConfig:
    """The validated engine config of a `vllm serve` namespace (no model is loaded).

    Raises:
        ValueError / FileNotFoundError: an invalid flag value or a missing
            model; `vllm serve` prints the message as a usage error (exit 2).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def _start_engine(vllm_config: VllmConfig, args: argparse.Namespace) -> AsyncLLM:
    """The engine (its core in a process of its own).

    Raises:
        EngineStartupError: the engine refused the configuration (a ValueError
            or a missing file while it loaded, sized or warmed up: exit code 2)
            or the device cannot hold its KV cache (exit code 1); one line.
    """
    with startup_errors():
        return AsyncLLM.from_vllm_config(
            vllm_config,
            log_stats=not getattr(args, "disable_log_stats", False),
            log_requests=bool(getattr(args, "enable_log_requests", False)),
        )


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the server's event loop: uvloop's where installed (libuv's loop and C
    transports: less time a chunk written), else asyncio's, as vLLM does."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def run_server(
    args: argparse.Namespace,
    vllm_config: VllmConfig | None = None,
    sock: socket.socket | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code (0 clean, 1 engine died).

    `vllm_config` is `build_engine_config(args)` and `sock` is
    `bind_socket(host, port)` when not given (`vllm serve` binds before it
    imports this module, so a taken port fails at once). The socket is closed
    on return.
    """
    if vllm_config is None:
        vllm_config = build_engine_config(args)
    host = args.host or "0.0.0.0"
    if sock is None:
        sock = bind_socket(host, args.port)
    try:
        port = sock.getsockname()[1]
        scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
        url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        logger.info("vLLM API server version %s, non-default args: %s", __version__,
                    non_default_args(args))
        engine = _start_engine(vllm_config, args)
        try:
            app = build_app(engine, args)
            shutdown_timeout = getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
            config = uvicorn.Config(
                app,
                log_level=args.uvicorn_log_level,
                access_log=not getattr(args, "disable_uvicorn_access_log", False),
                timeout_graceful_shutdown=shutdown_timeout + _SHUTDOWN_FLUSH_S,
                timeout_keep_alive=5,
                ssl_keyfile=getattr(args, "ssl_keyfile", None),
                ssl_certfile=getattr(args, "ssl_certfile", None),
                ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
                root_path=getattr(args, "root_path", None) or "",
            )
            server = _Server(config, url, engine, shutdown_timeout)
            engine.add_dead_callback(server.exit_after_engine_death)
            _run_loop(server.serve(sockets=[sock]))
            return server.exit_code
        finally:
            engine.shutdown()
    finally:
        sock.close()
