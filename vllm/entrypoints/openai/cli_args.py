"""The flags of `vllm serve` (the server's own, then every EngineArgs flag) and the
checks that run before anything heavy is imported: flag values, the chat template,
the listening socket.

Imports nothing heavy (no torch, no FastAPI), so `vllm --help` stays fast and a
bad flag or a taken port fails in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
from pathlib import Path

from vllm import envs
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.reasoning import ReasoningParserManager

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_PORT = 8000
# Seconds in-flight requests get to finish after SIGTERM/SIGINT (vLLM's
# --shutdown-timeout; vLLM defaults to 0, i.e. fail them at once: here a short
# drain is the default, as the server always had).
DEFAULT_SHUTDOWN_TIMEOUT_S = 10


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the positional MODEL, the server flags and the engine flags to `parser`."""
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="Model to serve: an HF model directory or a .gguf file (same as --model; "
             "default: the bundled SmolLM2-135M-Instruct).")
    g = parser.add_argument_group("Server")
    g.add_argument("--host", type=str, default=None,
                   help="Address to listen on (default: all interfaces, 0.0.0.0).")
    g.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"Port to listen on (default: {DEFAULT_PORT}; 0 picks a free one).")
    g.add_argument("--api-key", type=str, default=None,
                   help="Require 'Authorization: Bearer <key>' on /v1/* (default: "
                        "$VLLM_API_KEY, else no key).")
    g.add_argument("--served-model-name", type=str, nargs="+", default=None,
                   help="Names the API accepts as `model`; the first is reported (default: "
                        "the MODEL argument, or SmolLM2-135M-Instruct).")
    g.add_argument("--chat-template", type=str, default=None,
                   help="Chat template (a file or an inline Jinja string) replacing the model's "
                        "(default: the model's own).")
    g.add_argument("--default-chat-template-kwargs", type=str, default=None, metavar="JSON",
                   help="Chat template variables for every chat request, a JSON object (e.g. "
                        "'{\"enable_thinking\": false}'); a request's chat_template_kwargs win "
                        "key by key (default: none).")
    g.add_argument("--reasoning-parser", type=str, default=None, metavar="NAME",
                   help="Split chat replies into reasoning_content and content: "
                        f"{', '.join(ReasoningParserManager.names())} (default: none; the "
                        "reasoning stays in content).")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Serve tool_choice 'auto' (also the default when a request has tools): "
                        "the model's tool calls are read by --tool-call-parser (default: off; "
                        "such requests get 400; 'required' and named choices work either way).")
    g.add_argument("--tool-call-parser", type=str, default=None, metavar="NAME",
                   help="The format of the model's tool calls: "
                        f"{', '.join(ToolParserManager.names())} (hermes: Qwen2.5/Qwen3, "
                        "Hermes; llama3_json: Llama 3.x JSON calls; default: none).")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="Name tokens 'token_id:N' in logprobs (completions and chat) unless a "
                        "request's return_tokens_as_token_ids says otherwise (default: off; "
                        "tokens are named by their text).")
    g.add_argument("--shutdown-timeout", type=int, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="Seconds in-flight requests get to finish after SIGTERM/SIGINT; then "
                        "they fail with 503 (a stream gets an error event and [DONE]) and the "
                        f"server exits (default: {DEFAULT_SHUTDOWN_TIMEOUT_S}; 0: at once).")
    g.add_argument("--uvicorn-log-level", type=str, choices=UVICORN_LOG_LEVELS, default="info",
                   help="Log level of uvicorn, the HTTP server (default: %(default)s).")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="Do not log one line per HTTP request (default: log them).")
    g.add_argument("--ssl-keyfile", type=str, default=None, help="Serve HTTPS with this "
                   "private key (PEM; with --ssl-certfile; default: plain HTTP).")
    g.add_argument("--ssl-certfile", type=str, default=None, help="The certificate (chain) "
                   "of --ssl-keyfile, PEM (default: none).")
    g.add_argument("--ssl-ca-certs", type=str, default=None,
                   help="CA certificates (PEM) that client certificates are checked "
                        "against (default: none).")
    g.add_argument("--root-path", type=str, default=None,
                   help="The path prefix a reverse proxy serves the API under (ASGI "
                        "root_path, e.g. /llm; default: none).")
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """Merge MODEL into --model and check the server's own flags.

    Raises:
        ValueError: MODEL and --model disagree, the port is out of range, a
            `VLLM_*` variable is malformed (vllm/envs.py), or the chat template is
            neither a file nor a template, --default-chat-template-kwargs is not a
            JSON object of template variables, --reasoning-parser or
            --tool-call-parser names no parser, or --enable-auto-tool-choice comes
            without --tool-call-parser.
    """
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(
                f"the positional MODEL {args.model_tag!r} and --model {args.model!r} differ; "
                "give one of them"
            )
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    envs.validate()  # a malformed VLLM_* variable fails here, in one line
    if args.api_key is None:
        args.api_key = envs.VLLM_API_KEY
    load_chat_template(args.chat_template)
    check_ssl_files(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)
    if args.root_path is not None and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    args.default_chat_template_kwargs = parse_chat_template_kwargs(
        args.default_chat_template_kwargs)
    if args.reasoning_parser is not None and (
            args.reasoning_parser not in ReasoningParserManager.names()):
        raise ValueError(f"--reasoning-parser {args.reasoning_parser!r} is not one of "
                         f"{', '.join(ReasoningParserManager.names())}")
    args.structured_outputs_config = _with_reasoning_parser(args.structured_outputs_config,
                                                            args.reasoning_parser)
    if args.tool_call_parser is not None and (
            args.tool_call_parser not in ToolParserManager.names()):
        raise ValueError(f"--tool-call-parser {args.tool_call_parser!r} is not one of "
                         f"{', '.join(ToolParserManager.names())}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (one of "
                         f"{', '.join(ToolParserManager.names())})")


def check_ssl_files(keyfile: str | None, certfile: str | None, ca_certs: str | None) -> None:
    """The HTTPS flags name a key and a certificate that belong together (as uvicorn loads
    them), so a typo fails at start-up in one line, not after the model has loaded.

    Raises:
        ValueError: one of the pair missing, a file missing, or a key and certificate
            that `ssl` cannot load together (its reason).
    """
    if keyfile is None and certfile is None:
        if ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return
    if keyfile is None or certfile is None:
        missing = "--ssl-keyfile" if keyfile is None else "--ssl-certfile"
        raise ValueError(f"HTTPS needs both --ssl-keyfile and --ssl-certfile; {missing} is "
                         "missing")
    import ssl

    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile),
                       ("--ssl-ca-certs", ca_certs)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path!r} is not a file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
        if ca_certs is not None:
            context.load_verify_locations(ca_certs)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"HTTPS: --ssl-keyfile {keyfile!r} and --ssl-certfile {certfile!r} "
                         f"cannot be loaded together: {e}") from None


def parse_chat_template_kwargs(value: str | dict | None) -> dict | None:
    """`--default-chat-template-kwargs`: a JSON object of template variables.

    Raises:
        ValueError: not JSON, not an object, or a key the request sets itself
            (`tokenize`, `tools`, ...: `chat_templates.RESERVED_TEMPLATE_KWARGS`).
    """
    from vllm.transformers_utils.chat_templates import check_chat_template_kwargs

    if value is None or isinstance(value, dict):  # already parsed (build_app after validate)
        parsed = value
    else:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--default-chat-template-kwargs is not valid JSON: {e}") from e
    if parsed is None:
        return None
    return check_chat_template_kwargs(parsed, "--default-chat-template-kwargs")


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a template.

    Raises:
        ValueError: neither an existing file nor a Jinja template, or a template
            Jinja cannot parse (at start-up, not at every chat request).
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return _check_template_syntax(path.read_text(), repr(value))
    if "{" in value:
        return _check_template_syntax(value, "")
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _check_template_syntax(template: str, source: str) -> str:
    """Parse as transformers' `apply_chat_template` will (loop controls, and its
    `{% generation %}` block), without importing transformers (start-up checks run
    before the heavy imports)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols, GenerationBlock]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        where = f" {source}" if source else ""
        raise ValueError(f"--chat-template{where} is not a valid Jinja template: {e.message} "
                         f"(line {e.lineno})") from e
    return template


def _with_reasoning_parser(config: StructuredOutputsConfig | None,
                           reasoning_parser: str | None) -> StructuredOutputsConfig | None:
    """--reasoning-parser also tells the engine where a reply's reasoning ends (grammars
    apply after it), as vLLM's StructuredOutputsConfig.reasoning_parser.

    Raises:
        ValueError: --structured-outputs-config names another reasoning_parser.
    """
    if reasoning_parser is None:
        return config
    config = config or StructuredOutputsConfig()
    if config.reasoning_parser not in (None, reasoning_parser):
        raise ValueError(f"--reasoning-parser {reasoning_parser} and --structured-outputs-"
                         f"config reasoning_parser {config.reasoning_parser} disagree")
    return dataclasses.replace(config, reasoning_parser=reasoning_parser)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (listen() is called by the event loop).

    Raises:
        OSError: the address is in use or not available; `strerror` names it
            ("cannot listen on 127.0.0.1:8000: Address already in use").
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock
