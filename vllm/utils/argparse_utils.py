"""`FlexibleArgumentParser` and `DefaultsHelpFormatter`: the `vllm` CLI's argparse, as vLLM's.

Imports only argparse (`vllm --help` stays torch-free).

    vllm serve --max_model_len=64 --enable_prefix_caching  (as typed)
    vllm serve --max-model-len=64 --enable-prefix-caching  (as parsed)
               ^^^^^^^^^^^^^^^ only the flag's name is rewritten; "=64" and
                               any argument not starting with "--" are kept
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def dashed_long_options(args: Sequence[str]) -> list[str]:
    """`args` with "_" -> "-" in the names of long options (`--foo_bar[=v]` -> `--foo-bar[=v]`).

    Values (the text after "=", or a separate argument not starting with
    "--") are untouched, and so is everything after a bare "--" (positional
    arguments by argparse's convention). vLLM's FlexibleArgumentParser does the
    same, so `--max_model_len` works wherever `--max-model-len` does.
    """
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg == "--":
            out.append(arg)
            out.extend(rest)
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that accepts `--foo_bar` for `--foo-bar` (vLLM's class of this name).

    The rewrite happens in `parse_known_args`, which `parse_args` and
    argparse's sub-command dispatch both call, so a parser and its
    sub-parsers all accept either spelling. Help shows defaults
    (`DefaultsHelpFormatter`) unless another formatter_class is given.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args(dashed_long_options(args), namespace)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after a flag's help, unless the help already states a default.

    The engine and server flags word their defaults themselves ("default: on
    where the platform supports it", "default: the model's"), which a bare
    value could not say; those keep their text, and no help shows a default twice.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)
