"""Constraint -> xgrammar grammar (`build_grammar`) or llguidance grammar
(`guidance.build_guidance_grammar`), and the compile pool (`GrammarCompiler`), without an
engine: every kind parses, a bad one names its field, "auto" falls back to llguidance for
what xgrammar cannot parse, identical constraints share one compile, a failed compile's
future raises, the cache is bounded, both backends' matchers agree on a real tokenizer."""

from __future__ import annotations

import threading

import pytest

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1 import structured_output
from vllm.v1.structured_output import (
    GrammarCompiler,
    backend_tokenizers,
    build_grammar,
    check_backend,
    choose_backend,
    guidance,
)

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
    # Where the constraint came from is the server's to say, not a body key.
    with pytest.raises(VLLMValidationError, match="unknown keys"):
        StructuredOutputsParams.from_dict({"regex": "a", "source_field": "tools"})


def test_a_request_may_only_name_the_engines_backend():
    """vLLM V1's rule for guided_decoding_backend (no per-request backend)."""
    check_backend(None, "guidance")
    check_backend("xgrammar", "xgrammar")
    check_backend("guidance", "llguidance")  # the same backend, two spellings
    for requested, engine in [("outlines", "auto"), ("guidance", "xgrammar"),
                              ("xgrammar", "guidance")]:
        with pytest.raises(VLLMValidationError, match="cannot be chosen per request") as e:
            check_backend(requested, engine, "guided_decoding_backend")
        assert e.value.parameter == "guided_decoding_backend"


@pytest.mark.parametrize("fields", [
    {"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}}},
    {"json": '{"type": "array", "items": {"type": "string"}}'},
    {"regex": "[a-z]{2}"},
    {"choice": ["a", 'b "quoted"', "c\\d"]},
    {"grammar": 'root ::= "x" | "y"'},  # GBNF, as xgrammar's
    {"grammar": 'start: "x" | "y"'},  # Lark
    {"json_object": True},
])
def test_every_kind_but_structural_tags_parses_with_llguidance(fields):
    params = StructuredOutputsParams(**fields)
    llg = pytest.importorskip("llguidance")
    text = guidance.build_guidance_grammar(params)  # Lark text or llguidance's JSON
    assert text and llg.LLMatcher.validate_grammar(text) == ""
    assert choose_backend(params, "guidance") == "guidance"


def test_llguidance_schemas_refuse_unnamed_properties_as_xgrammar_does():
    schema = {"type": "object", "properties": {"o": {"type": "object", "properties": {
        "additionalProperties": {"type": "integer"}}}, "e": {"enum": [{"x": 1}]}}}
    assert guidance._closed(schema) == {"type": "object", "additionalProperties": False,
                                        "properties": {"o": {
                                            "type": "object", "additionalProperties": False,
                                            "properties": {"additionalProperties": {
                                                "type": "integer"}}},
                                            "e": {"enum": [{"x": 1}]}}}
    assert guidance._closed({"type": "object", "additionalProperties": True}) == {
        "type": "object", "additionalProperties": True}


@pytest.mark.parametrize("fields, field", [
    ({"json": {"type": "no-such-type"}}, "json"),
    ({"json": '{"type": '}, "json"),
    ({"regex": "(a"}, "regex"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({"structural_tag": {"structures": [TAG], "triggers": ["<f>"]}}, "structural_tag"),
])
def test_a_constraint_llguidance_cannot_parse_names_its_field(fields, field):
    with pytest.raises(VLLMValidationError) as info:
        choose_backend(StructuredOutputsParams(**fields), "llguidance")
    assert info.value.parameter == field and "llguidance" in str(info.value)


def test_auto_takes_xgrammar_and_falls_back_to_llguidance():
    unicode_class = StructuredOutputsParams(regex=r"\p{L}+")  # not in xgrammar's syntax
    pattern = StructuredOutputsParams(json={"type": "string", "pattern": r"^\p{L}+$"})
    assert choose_backend(StructuredOutputsParams(regex="ab"), "auto") == "xgrammar"
    for params in (unicode_class, pattern):
        assert choose_backend(params, "auto") == "guidance"
        with pytest.raises(VLLMValidationError, match="xgrammar") as info:
            choose_backend(params, "xgrammar")
        assert info.value.parameter == params.kind
    bad = StructuredOutputsParams(regex="(a")
    with pytest.raises(VLLMValidationError, match="xgrammar"):  # neither: xgrammar's reason
        choose_backend(bad, "auto")


@pytest.fixture(scope="module")
def compiler():
    from vllm.transformers_utils.config import get_bundled_model_path

    compiler = GrammarCompiler(get_bundled_model_path(), 49152, [2])
    yield compiler
    compiler.shutdown()


def test_the_backends_tokenizer_builds_at_start_up_and_start_up_does_not_wait(monkeypatch):
    """Made, the compiler starts the tokenizer's build on its own thread and returns at
    once; a compile submitted meanwhile waits for it (its request in WAITING_FOR_FSM),
    then compiles; a second compiler for the same key reuses the build: one per process."""
    release, calls = threading.Event(), []
    build = backend_tokenizers._build

    def held_build(key):
        calls.append(key)
        assert release.wait(60)
        return build(key)

    monkeypatch.setattr(backend_tokenizers, "_build", held_build)
    monkeypatch.setattr(backend_tokenizers, "_BUILDS", {})
    from vllm.transformers_utils.config import get_bundled_model_path

    first = GrammarCompiler(get_bundled_model_path(), 49152, [2])
    second = GrammarCompiler(get_bundled_model_path(), 49152, [2])
    try:
        assert not first.ready.done() and second.ready is first.ready
        future = first.submit(StructuredOutputsParams(regex="ab+c"))
        assert not future.done()  # no request ran: the build does not wait for one
        release.set()
        assert isinstance(future.result(timeout=60).grammar, xgr.CompiledGrammar)
        assert first.ready.result().info.vocab_size == 49152
        second.submit(StructuredOutputsParams(regex="xy+z")).result(timeout=60)
        assert len(calls) == 1 and calls[0].backend == "xgrammar"
    finally:
        release.set()
        first.shutdown()
        second.shutdown()


def test_a_failed_tokenizer_build_fails_the_compiles_and_is_retried(monkeypatch):
    monkeypatch.setattr(backend_tokenizers, "_BUILDS", {})
    compiler = GrammarCompiler("/nonexistent/tokenizer", 1000, [0])
    try:
        with pytest.raises(FileNotFoundError):
            compiler.submit(StructuredOutputsParams(regex="a")).result(timeout=60)
        assert compiler.ready.exception() is not None
        assert backend_tokenizers.prepare(compiler.tokenizer_key) is not compiler.ready
    finally:
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


@pytest.fixture(scope="module")
def guidance_compiler():
    from vllm.transformers_utils.config import get_bundled_model_path

    compiler = GrammarCompiler(get_bundled_model_path(), 49152, [2], backend="llguidance")
    yield compiler
    compiler.shutdown()


@pytest.mark.parametrize("fields, text", [
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, "123-ab"),
    ({"choice": ["yes, sure", "no"]}, "yes, sure"),
])
def test_both_backends_walk_a_reply_on_the_bundled_tokenizer(
        compiler, guidance_compiler, fields, text):
    """Along a reply's tokens (then the stop token, 2), xgrammar's and llguidance's masks
    allow each next token and refuse "#" and the stop token before the end; the stop
    token terminates both. (Their masks are not equal: llguidance also refuses tokens
    that would spell a forced string in a non-canonical way, e.g. " s" before "ure".)"""
    import torch

    params = StructuredOutputsParams(**fields)
    matchers = [c.submit(params).result(timeout=120).new_matcher()
                for c in (compiler, guidance_compiler)]
    assert type(guidance_compiler.submit(params).result()).__name__ == "GuidanceGrammar"
    tokenizer = compiler.ready.result().tokenizer
    tokens, (wrong,) = tokenizer.encode(text) + [2], tokenizer.encode("#")
    masks = torch.zeros(2, 49152 // 32, dtype=torch.int32)

    def allows(row: int, token: int) -> bool:
        return bool((int(masks[row, token // 32]) >> (token % 32)) & 1)

    for token in tokens:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(masks, row)
            assert allows(row, token) and not allows(row, wrong)
            assert allows(row, 2) == (token == 2)
        assert [m.accept_token(wrong) for m in matchers] == [False, False]
        assert [m.accept_token(token) for m in matchers] == [True, True]
        assert [m.is_terminated() for m in matchers] == [token == 2] * 2


def test_where_a_reply_starts_is_read_from_the_prompts_tail():
    from vllm.v1.structured_output.reasoning import (
        BEFORE,
        CONTENT,
        REASONING,
        ReasoningTokens,
    )

    think, end, blank, word = 5, 6, 7, 8
    qwen3 = ReasoningTokens(think, end, False, frozenset({blank}))
    deepseek = ReasoningTokens(think, end, True, frozenset({blank}))
    assert qwen3.state_after([word, think, end, blank, blank]) == CONTENT  # thinking off
    assert qwen3.state_after([word, think, blank]) == REASONING  # the template opened it
    # Tags earlier in the conversation do not count: only the generation prompt's tail.
    assert qwen3.state_after([think, end, word]) == BEFORE
    assert deepseek.state_after([think, end, word]) == REASONING
    assert deepseek.state_after([word, end]) == CONTENT


def test_reasoning_tokens_of_a_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tests.entrypoints.openai.scripted_model import build_scripted_model
    from vllm.v1.structured_output.reasoning import REASONING_TAGS, ReasoningTokens

    tokenizer = AutoTokenizer.from_pretrained(build_scripted_model(tmp_path))
    tokens = ReasoningTokens.of(REASONING_TAGS["qwen3"], tokenizer)
    assert tokenizer.decode([tokens.start_id, tokens.end_id]) == "<think></think>"
    assert tokenizer.encode("\n")[0] in tokens.whitespace_ids
    with pytest.raises(VLLMValidationError, match=r"\['<nope>'\] are not tokens"):
        ReasoningTokens.of(("<nope>", "</think>", False), tokenizer)


# A worker process: it unpickles the core's grammars, counting tokenizer builds and
# xgrammar TokenizerInfo deserializations, and checks each grammar's first mask.
_WORKER = """
import pickle, sys, torch, xgrammar as xgr
from vllm.v1.structured_output import backend_tokenizers
builds, rebuilds = [], []
build = backend_tokenizers._build
backend_tokenizers._build = lambda key: builds.append(key) or build(key)
deserialize = xgr.TokenizerInfo.deserialize_json
xgr.TokenizerInfo.deserialize_json = staticmethod(
    lambda *a: rebuilds.append(1) or deserialize(*a))
loads = []
deserialize_grammar = xgr.CompiledGrammar.deserialize_json
xgr.CompiledGrammar.deserialize_json = staticmethod(
    lambda *a: loads.append(1) or deserialize_grammar(*a))
mask = torch.zeros(1, 49152 // 32, dtype=torch.int32)
for one in pickle.loads(sys.stdin.buffer.read()):  # one pickle per request
    pickle.loads(one).new_matcher().fill_next_token_bitmask(mask, 0)
    assert int(mask.ne(0).sum()) > 0
print(len(builds), len(rebuilds), len(loads))
"""


def test_a_worker_process_builds_its_tokenizer_once_for_many_grammars(compiler):
    """Grammars pickled to another process carry their tokenizer's key: that process
    builds its TokenizerInfo once for all of them (not one per grammar, from JSON), and
    deserializes each distinct grammar once (8 requests, 4 grammars)."""
    import pickle
    import subprocess
    import sys

    grammars = [compiler.submit(StructuredOutputsParams(regex=f"w{i}[0-9]+")).result(timeout=60)
                for i in range(4)]
    requests = [pickle.dumps(g) for g in grammars * 2]
    assert max(map(len, requests)) < 100_000  # the vocabulary's TokenizerInfo JSON: 1.6 MB
    done = subprocess.run([sys.executable, "-c", _WORKER], input=pickle.dumps(requests),
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split()[-3:] == ["1", "0", "4"]
