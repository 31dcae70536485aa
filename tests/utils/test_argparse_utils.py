"""`vllm.utils.argparse_utils`: long options' underscores become dashes, values do not."""

from __future__ import annotations

import argparse

import pytest

from vllm.utils.argparse_utils import FlexibleArgumentParser, dashed_long_options


def test_only_long_option_names_are_rewritten():
    assert dashed_long_options(
        ["--max_model_len=4_096", "x_y", "-O", "-tp_x", "--a-b", "--", "--c_d"]
    ) == ["--max-model-len=4_096", "x_y", "-O", "-tp_x", "--a-b", "--", "--c_d"]


def test_parser_and_its_subparsers_take_both_spellings(monkeypatch):
    parser = FlexibleArgumentParser(prog="p")
    parser.add_argument("--top-flag", type=int)
    sub = parser.add_subparsers(dest="cmd").add_parser("run")
    sub.add_argument("--inner-flag")
    monkeypatch.setattr("sys.argv", ["p", "--top_flag", "1", "run", "--inner_flag=a_b"])
    args = parser.parse_args()
    assert (args.top_flag, args.cmd, args.inner_flag) == (1, "run", "a_b")
    assert type(sub) is FlexibleArgumentParser  # subparsers take their parent's class


def test_help_appends_a_default_only_where_none_is_stated():
    parser = FlexibleArgumentParser(prog="p")
    parser.add_argument("--plain", type=int, default=3, help="Plain.")
    parser.add_argument("--worded", default=None, help="Worded (default: the model's).")
    text = " ".join(parser.format_help().split())
    assert "Plain. (default: 3)" in text
    assert "Worded (default: the model's)." in text and "(default: None)" not in text


def test_unknown_flag_is_reported_dashed(capsys):
    parser = FlexibleArgumentParser(prog="p")
    with pytest.raises(SystemExit):
        parser.parse_args(["--no_such"])
    assert "unrecognized arguments: --no-such" in capsys.readouterr().err


def test_is_an_argument_parser():
    assert issubclass(FlexibleArgumentParser, argparse.ArgumentParser)
