"""Argument types, JSON output and the offline run shared by the `vllm bench` subcommands."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse turns the ValueError into a usage error)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 ("inf" allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def check_output_path(path: str | None) -> None:
    """Raise ValueError now, before a run, when `path` could not be written afterwards.

    A path is writable when it is not a directory and a file can be created in
    its nearest existing ancestor (tried with a temporary file, removed at
    once; `write_json` creates the missing directories). None passes.
    """
    if path is None:
        return
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise ValueError(f"output path {path!r} is a directory; give a file name")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"output path {path!r}: {str(parent)!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ValueError(f"output path {path!r}: cannot write in {str(parent)!r} "
                         f"({e.strerror or e})") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"output path {path!r} exists and is not writable")


def write_json(path: str, result: dict) -> None:
    """Write `result` as indented, strict JSON to `path` (its directory is created).

    Raises ValueError for a NaN or infinite number (strict parsers reject them:
    callers report empty statistics as 0, as vLLM does) and OSError when the
    file cannot be written (`check_output_path` catches the usual causes first).
    """
    text = json.dumps(result, indent=2, allow_nan=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Path(path).write_text(text + "\n")


def add_length_args(parser: argparse.ArgumentParser, input_len: int) -> None:
    """`--input-len` (default `input_len`) and `--output-len` (128) of an offline benchmark."""
    parser.add_argument("--input-len", type=positive_int, default=input_len,
                        help="Prompt tokens.")
    parser.add_argument("--output-len", type=positive_int, default=128, help="Output tokens.")


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """`--disable-tqdm`, `--output-json` and `vllm serve`'s engine flags, which close the
    flags of an offline benchmark (`run_offline` reads them)."""
    from vllm.engine.arg_utils import EngineArgs

    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    parser.add_argument("--output-json", default=None, help="Also write the results here.")
    EngineArgs.add_cli_args(parser)


def run_offline(args: argparse.Namespace, run: Callable[[object, argparse.Namespace], dict],
                max_num_seqs_at_least: int = 0) -> int:
    """`vllm bench latency|throughput`'s main: check `--output-json`, build the offline
    engine from the flags, `run(llm, args)`, shut the engine down, write the JSON; 0.

    Raises:
        ValueError: an output path that could not be written (before the engine
            is built), or a bad flag value; see `make_llm` for the engine's errors.
        OSError: the JSON could not be written after all.
    """
    from vllm.benchmarks.offline import make_llm

    check_output_path(args.output_json)
    llm = make_llm(args, max_num_seqs_at_least=max_num_seqs_at_least)
    try:
        result = run(llm, args)
    finally:
        llm.llm_engine.shutdown()
    if args.output_json:
        write_json(args.output_json, result)
    return 0
