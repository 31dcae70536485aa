"""Argument types and JSON output shared by the `vllm bench` subcommands."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse turns the ValueError into a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
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
