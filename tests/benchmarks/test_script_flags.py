"""The scripts under benchmarks/: every flag explains itself, a model shape is one of
benchmarks/common.py's (or the script's own fixed set), and a count of 0 or less is a
usage error, so a typo ends at once with exit 2 instead of a traceback an hour later.

Each script's parser is taken from its `main()`: `parse_args` is replaced by a stub that
raises with the parser, so nothing is run. (benchmark_serving.py is kept with
`vllm bench serve` and not covered here; elastic_loads.py and elastic_plot.py are parts of
benchmark_elastic.py, not scripts.)
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

import pytest

from tests.entrypoints.openai.utils import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
NOT_SCRIPTS = ("common", "benchmark_serving", "elastic_loads", "elastic_plot")
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in NOT_SCRIPTS)
# Flags whose value may be 0 or negative (a random seed).
ANY_INT = {"seed"}


class _Parser(Exception):
    pass


@pytest.fixture
def scripts(monkeypatch):
    """import_module over benchmarks/ as the scripts see it (their `common` beside them)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def _parser_of(module, monkeypatch) -> argparse.ArgumentParser:
    def stop(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(sys, "argv", [module.__name__])
    with pytest.raises(_Parser) as info:
        module.main()
    monkeypatch.undo()
    return info.value.args[0]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_has_help_shapes_have_choices_and_counts_are_positive(name, scripts,
                                                                         monkeypatch):
    common = scripts("common")
    module = scripts(name)
    parser = _parser_of(module, monkeypatch)
    assert _options(parser), name
    for action in _options(parser):
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{name} {flag}: no help text"
        if action.dest in ("shape", "shapes"):
            assert action.choices, f"{name} {flag}: no choices"
            # benchmark_gemv's shapes are projections (benchmark_decode_primitives').
            known = {*common.SHAPES, *common.MULTIMODAL_SHAPES, "tiny",
                     *getattr(module, "PROJECTIONS", ())}
            assert set(action.choices) <= known, (name, action.choices)
        if action.type is int:  # a bare int takes 0 and negatives
            assert action.dest in ANY_INT, f"{name} {flag}: int, not a positive int"


def _run(module, argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("name", "argv"), [
    ("benchmark_ttft_by_length", ["--shapes", "bogus", "--allow-cpu"]),
    ("benchmark_throughput", ["--shapes", "smollm2", "bogus"]),
])
def test_an_unknown_shape_is_a_usage_error(name, argv, scripts, monkeypatch, capsys):
    """It was a KeyError traceback from common.model_dir_for."""
    err = _run(scripts(name), argv, monkeypatch, capsys)
    choices = ", ".join(map(repr, scripts("common").SHAPES))
    assert err == (f"{name}.py: error: argument --shapes: invalid choice: 'bogus' "
                   f"(choose from {choices})")


@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("name", ["benchmark_throughput", "benchmark_engine_steps",
                                  "benchmark_decode_profile"])
def test_batch_sizes_below_one_are_usage_errors(name, value, scripts, monkeypatch, capsys):
    err = _run(scripts(name), ["--batch-sizes", "1", value], monkeypatch, capsys)
    assert err == f"{name}.py: error: argument --batch-sizes: must be an integer >= 1, got {value}"


def test_benchmark_docs_write_results_where_the_results_live():
    """The commands run from the repository root (`python benchmarks/...`); their results
    are kept in benchmarks/results/, so an `--out` there says so."""
    texts = [(BENCHMARKS.parent / "docs" / "benchmarks.md").read_text(),
             (BENCHMARKS / "README.md").read_text(),
             *(p.read_text() for p in BENCHMARKS.glob("*.py"))]
    outs = [m for text in texts for m in re.findall(r"--out (\S*results/\S+)", text)]
    assert outs and all(o.startswith("benchmarks/results/") for o in outs), outs
