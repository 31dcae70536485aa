"""Constraint -> xgrammar grammar (`build_grammar`) and the compile pool (`GrammarCompiler`),
without an engine: every kind parses, a bad one names its field, identical constraints
share one compile, a failed compile's future raises, the cache is bounded."""

from __future__ import annotations

import pytest

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1 import structured_output
from vllm.v1.structured_output import GrammarCompiler, build_grammar, check_backend

xgr = pytest.importorskip("xgrammar")

TAG = {"begin": "<f>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
       "end": "</f>"}


@pytest.mark.parametrize("fields", [
    {"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}}},
    {"json": '{"type": "array", "items": {"type": "string"}}'},
    {"regex": "[a-z]{2}"},
    {"choice": ["a", 'b "quoted"', "c\\d"]},
    {"grammar": 'root ::= "x" | "y"'},
    {"json_object": True},
    {"structural_tag": {"structures": [TAG], "triggers": ["<f>"]}},  # vLLM's older form
    {"structural_tag": {"type": "structural_tag", "format": {
        "type": "const_string", "value": "hello"}}},
])
def test_every_kind_parses(fields):
    assert isinstance(build_grammar(StructuredOutputsParams(**fields)), xgr.Grammar)


def test_choice_matches_each_string_verbatim():
    grammar = build_grammar(StructuredOutputsParams(choice=['b "q"', "c\\d"]))
    info = xgr.TokenizerInfo(['b "q"', "c\\d", "b", "</s>"], stop_token_ids=[3])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    assert matcher.accept_token(1) and matcher.accept_token(3)  # "c\d" then the stop


@pytest.mark.parametrize("fields, field", [
    ({"json": {"type": "no-such-type"}}, "json"),
    ({"json": '{"type": '}, "json"),
    ({"regex": "(a"}, "regex"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({"structural_tag": '{"structures": 3}'}, "structural_tag"),
])
def test_a_bad_constraint_names_its_field(fields, field):
    with pytest.raises(VLLMValidationError) as info:
        build_grammar(StructuredOutputsParams(**fields))
    assert info.value.parameter == field and "cannot be compiled by xgrammar" in str(info.value)


@pytest.mark.parametrize("fields, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 1]}, "choice"),
    ({"regex": 5}, "regex"),
    ({"json_object": "yes"}, "json_object"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern"),
])
def test_malformed_params_name_the_field(fields, field):
    with pytest.raises(VLLMValidationError) as info:
        StructuredOutputsParams(**fields)
    assert info.value.parameter == field
    with pytest.raises(VLLMValidationError, match="unknown keys"):
        StructuredOutputsParams.from_dict({"regex": "a", "nope": 1})


def test_backends():
    check_backend(None)
    check_backend("xgrammar")
    with pytest.raises(VLLMValidationError, match="'outlines' is not available"):
        check_backend("outlines")


@pytest.fixture(scope="module")
def compiler():
    from vllm.transformers_utils.config import get_bundled_model_path
    from vllm.transformers_utils.tokenizer import get_tokenizer

    compiler = GrammarCompiler(lambda: get_tokenizer(get_bundled_model_path()), 49152, [2])
    yield compiler
    compiler.shutdown()


def test_identical_constraints_share_one_compile(compiler):
    before = compiler.num_compiles
    first = compiler.submit(StructuredOutputsParams(json={"type": "object", "title": "t1"}))
    again = compiler.submit(StructuredOutputsParams(json='{"title": "t1", "type": "object"}'))
    assert again is first and compiler.num_compiles == before + 1
    grammar = first.result(timeout=60).grammar
    assert isinstance(grammar, xgr.CompiledGrammar)
    assert grammar.tokenizer_info.vocab_size == 49152
    assert 2 in grammar.tokenizer_info.stop_token_ids
    other = compiler.submit(StructuredOutputsParams(json={"type": "object", "title": "t1"},
                                                    disable_any_whitespace=True))
    assert other is not first


def test_a_failed_compile_raises_from_its_future(compiler):
    future = compiler.submit(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(VLLMValidationError):
        future.result(timeout=60)
    # A failure is not cached: the next submit compiles again.
    assert compiler.submit(StructuredOutputsParams(regex="(unclosed")) is not future


def test_the_cache_is_bounded(compiler, monkeypatch):
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_SIZE", 2)
    futures = [compiler.submit(StructuredOutputsParams(regex=f"a{i}")) for i in range(3)]
    assert len(compiler._cache) == 2
    assert compiler.submit(StructuredOutputsParams(regex="a2")) is futures[2]
    assert compiler.submit(StructuredOutputsParams(regex="a0")) is not futures[0]
