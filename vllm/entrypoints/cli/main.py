"""The `vllm` console script: `vllm serve [MODEL] [flags]`, `vllm bench`, `vllm kv-top`,
`vllm --help`, `vllm --version`.

Parsing imports only argparse and the (torch-free) EngineArgs, so `--help`
and `--version` answer in a fraction of a second; the server (FastAPI,
torch, the model) is imported only when `serve` runs. As in vLLM, every
parser takes `--foo_bar` for `--foo-bar` and every subcommand's help shows the
defaults (`vllm.utils.argparse_utils`).
"""

from __future__ import annotations

import argparse
import signal
import sys

from vllm.entrypoints.cli import kv_top
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.version import __version__


def _first_line(text: str) -> str:
    return " ".join(text.split())


def _options_summary(parser: argparse.ArgumentParser, name: str) -> str:
    """`vllm <name>`'s options, one line each, for the top-level help's epilog.

    `%(default)s` in a help text is filled in as argparse does for `--help`.
    """
    lines = [f"`vllm {name}` options (details: vllm {name} --help):"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(action.option_strings) or (action.metavar or action.dest)
        text = (action.help or "") % dict(vars(action), prog=parser.prog)
        lines.append(f"  {flags:<36} {_first_line(text)}")
    return "\n".join(lines)


class _SubcommandParser(FlexibleArgumentParser):
    """A subcommand's parser: unknown flags are reported with *its* usage line.

    argparse hands a subparser's leftovers back to the top-level parser, whose
    error would print `usage: vllm [-h] ...` for `vllm serve --bogus-flag`.
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        """A bad flag: one line, `vllm serve: error: ...` as every start-up error, exit 2
        (argparse would print the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} "
                     f"(see {self.prog} --help)\n")


def make_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    parser = FlexibleArgumentParser(
        prog="vllm",
        description="vLLM with an extensible KV cache: serve a model over the OpenAI API.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--version", action="version", version=__version__,
                        help="Print the version and exit.")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND",
                                       parser_class=_SubcommandParser)
    serve = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible HTTP server (vllm serve [MODEL] [flags]).",
        description="Start the OpenAI-compatible HTTP server for MODEL (default: the "
                    "bundled SmolLM2-135M-Instruct).",
        usage="vllm serve [MODEL] [options]",
    )
    make_arg_parser(serve)
    serve.set_defaults(dispatch=_cmd_serve)
    _add_bench(subparsers)
    kv_top.add_parser(subparsers)
    parser.epilog = _options_summary(serve, "serve")
    return parser


_BENCH = {
    "latency": "Latency of one batch, offline (vLLM's `vllm bench latency`).",
    "throughput": "Offline throughput of many prompts (vLLM's `vllm bench throughput`).",
    "serve": "Load a running server over the OpenAI API (vLLM's `vllm bench serve`).",
}


def _add_bench(subparsers) -> None:
    """`vllm bench latency|throughput|serve` (code in vllm/benchmarks/)."""
    import importlib

    bench = subparsers.add_parser(
        "bench", help="Benchmarks: latency, throughput (offline), serve (a running server).",
        description="Benchmarks built on vllm/benchmarks (the benchmarks/ scripts share them).",
        usage="vllm bench {latency,throughput,serve} [options]",
    )
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND",
                                 parser_class=_SubcommandParser)
    for kind, text in _BENCH.items():
        sub = kinds.add_parser(kind, help=text, description=text, prog=f"vllm bench {kind}",
                               usage=f"vllm bench {kind} [options]")
        importlib.import_module(f"vllm.benchmarks.{kind}").add_cli_args(sub)
        sub.set_defaults(dispatch=_cmd_bench)
    bench.set_defaults(dispatch=lambda args: bench.print_help() or 1)


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run `vllm bench <kind>`; what `vllm serve` reports in one line is one line here too.

    A bad flag value, a model path or an output path that cannot be written
    is a usage error (exit 2); what the offline engine refuses while it starts
    exits as `vllm serve` does for it (a KV cache the device cannot hold, a
    device held by another process: 1); a file that could not be written
    after the run is one line too (exit 2), and Ctrl-C is one line (exit 130),
    never a traceback.
    """
    import importlib

    from vllm.exceptions import DeviceBusyError, EngineStartupError

    command = f"bench {args.bench_kind}"
    module = importlib.import_module(f"vllm.benchmarks.{args.bench_kind}")
    try:
        return module.main(args)
    except (DeviceBusyError, EngineStartupError) as e:
        return _startup_error(command, e)
    except (ValueError, FileNotFoundError) as e:
        return _usage_error(command, e)
    except OSError as e:
        return _usage_error(command, _os_error_message(e))
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        print(f"vllm {command}: interrupted", file=sys.stderr)
        return 130


def _cmd_serve(args: argparse.Namespace) -> int:
    """Check the flags, bind the port, build the engine config, then serve.

    A bad flag value, a missing model or a port that cannot be bound is a
    usage error: one line on stderr, exit 2, no traceback. The flags and the
    port are checked before torch is imported (a fraction of a second); what
    needs the platform or the model's config (dtype, max_model_len) is checked
    when the config is built; what the engine refuses while it starts (a
    ValueError from loading or a connector's option, a KV cache the device
    cannot hold) is one line too (exit 2, or 1 for the device). Anything else
    raised later propagates. Ctrl-C or SIGTERM during start-up is one line
    too (exit 130 for Ctrl-C, 0 for a stop request), with every process of
    the engine stopped.
    """
    # Until uvicorn installs its own handlers (it drains), SIGTERM stops the start-up
    # as Ctrl-C does: one line, no traceback, and the engine's processes are stopped.
    # Restored on return (an in-process caller, e.g. a test, keeps its own).
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _serve(args)
    except _Terminated:  # a stop request before the server took over the signals
        print("vllm serve: stopped (SIGTERM) during start-up", file=sys.stderr)
        return 0
    except KeyboardInterrupt:  # Ctrl-C, ditto: the shell's status for SIGINT
        print("vllm serve: interrupted during start-up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class _Terminated(KeyboardInterrupt):
    """SIGTERM during start-up: unwinds as Ctrl-C does (every `except KeyboardInterrupt`
    and `finally` on the way stops what it started)."""


def _raise_terminated(signum: int, frame) -> None:
    raise _Terminated


def _serve(args: argparse.Namespace) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import bind_socket, validate_parsed_serve_args
    from vllm.exceptions import DeviceBusyError, EngineStartupError

    try:
        validate_parsed_serve_args(args)
        AsyncEngineArgs.from_cli_args(args).validate()
        sock = bind_socket(args.host or "0.0.0.0", args.port)
    except (ValueError, FileNotFoundError) as e:
        return _usage_error("serve", e)
    except OSError as e:  # the port (its message names it), or an unreadable template file
        return _usage_error("serve", _os_error_message(e))
    # The engine core process imports torch and the engine (seconds) while this
    # one imports the server and builds the configuration; it gets that config
    # when the engine client starts, or is stopped if building it fails.
    from vllm.v1.engine.core_launcher import (
        cancel_prestarted_engine_core,
        prestart_engine_core,
    )

    prestart_engine_core()
    try:
        from vllm.entrypoints.openai.api_server import build_engine_config, run_server

        try:
            vllm_config = build_engine_config(args)
        except (ValueError, FileNotFoundError) as e:
            return _usage_error("serve", e)
        try:
            return run_server(args, vllm_config, sock)
        except (DeviceBusyError, EngineStartupError) as e:
            return _startup_error("serve", e)
    finally:
        cancel_prestarted_engine_core()
        sock.close()


def _usage_error(subcommand: str, error: Exception | str) -> int:
    """Print `vllm <subcommand>: error: <message>` as one line on stderr; returns 2."""
    print(f"vllm {subcommand}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def _startup_error(subcommand: str, error: Exception) -> int:
    """The engine could not start: one line as `_usage_error`; returns the exit code.

    `EngineStartupError` carries its code (2: a configuration the engine cannot
    honour, 1: the device cannot hold it); `DeviceBusyError` (another process
    holds the device) is 1.
    """
    _usage_error(subcommand, error)
    return getattr(error, "exit_code", 1)


def _os_error_message(error: OSError) -> str:
    """The system's reason and the file ("Is a directory (/tmp)"), without the errno."""
    where = f" ({error.filename})" if error.filename else ""
    return f"{error.strerror or error}{where}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vllm` script; returns the process exit code.

    `vllm` alone prints the help and exits 0, as vLLM's CLI does (its subcommand
    is optional there, and without one it prints the help).
    """
    parser = make_parser()
    args = parser.parse_args(argv)
    dispatch = getattr(args, "dispatch", None)
    if dispatch is None:
        parser.print_help()
        return 0
    return dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
