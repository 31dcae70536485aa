"""Structured outputs through the offline `LLM` on the bundled model.

100 sampled replies to a JSON schema with a nested object, enums and an array
all validate (`jsonschema`), also with ngram speculative decoding (drafts the
grammar refuses are rejected); regex and choice replies match; a grammar whose
compile is held back does not stop another request from stepping; a
constraint the backend cannot parse is refused before the engine, naming the field.
The JSON, regex, choice, grammar and refusal tests run with both backends
(`backend_llm`: xgrammar, the default, and llguidance, `{"backend": "guidance"}`).
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from tests.v1.structured_output.schemas import MAX_TOKENS, NUM_REPLIES, PROMPT, SCHEMA
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.request import RequestStatus


def _json_params(n: int) -> list[SamplingParams]:
    """n sampled (seeded, temperature 1) requests for SCHEMA: each explores the grammar."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=so)
            for i in range(n)]


def _assert_all_validate(outputs) -> None:
    texts = [o.outputs[0].text for o in outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)
    assert len(set(texts)) > 1, "sampled replies should differ"


@pytest.fixture(scope="module")
def guidance_llm():
    from vllm import LLM

    llm = LLM(**ENGINE_KWARGS, structured_outputs_config={"backend": "guidance"})
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(params=["xgrammar", "guidance"])
def backend_llm(request):
    """The bundled engine with each backend (xgrammar: the session's shared engine)."""
    return request.getfixturevalue("bundled_llm" if request.param == "xgrammar"
                                   else "guidance_llm")


def test_the_backend_is_ready_after_start_up_without_a_structured_request(guidance_llm):
    """Start-up started the backend's tokenizer build (llguidance's here) in the
    background: it completes with no structured request sent and nothing compiled, and
    the worker's start-up (same process: the uni executor) found that build by its key
    instead of making a second one. (First in this module: guidance_llm is fresh.)"""
    from vllm.v1.structured_output import backend_tokenizers

    compiler = guidance_llm.llm_engine.engine_core.grammar_compiler
    built = compiler.ready.result(timeout=120)
    assert type(built.info).__name__ == "LLTokenizer" and built.build_s > 0
    assert compiler.num_compiles == 0
    key = backend_tokenizers.tokenizer_key_for(guidance_llm.llm_engine.vllm_config)
    assert key == compiler.tokenizer_key and key.backend == "guidance"
    assert backend_tokenizers.prepare(key) is compiler.ready


def test_100_json_schema_replies_validate(backend_llm):
    # llguidance: 32 replies (100 took 40 s on the 2-core CPU; 100 of 100 validated).
    backend = backend_llm.llm_engine.vllm_config.structured_outputs_config.backend
    n = NUM_REPLIES if backend == "auto" else 32
    outputs = backend_llm.generate([PROMPT] * n, _json_params(n), use_tqdm=False)
    assert len(outputs) == n
    _assert_all_validate(outputs)


def test_unconstrained_replies_are_not_json(bundled_llm):
    """The control: without the constraint the same requests do not produce the schema."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20) for i in range(4)]
    texts = [o.outputs[0].text for o in bundled_llm.generate([PROMPT] * 4, params,
                                                              use_tqdm=False)]
    assert not any(t.startswith('{"k"') for t in texts)


def test_regex_and_choice_replies_match(backend_llm):
    regex = r"(\d{3})-[a-z]{2,5}"
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                              structured_outputs=StructuredOutputsParams(regex=regex))
               for i in range(4)]
    choices = ["yes, sure", "no", "maybe \"later\""]
    chosen = [SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for i in range(4)]
    outputs = backend_llm.generate(["Call me at:"] * 4 + ["Will you?"] * 4, sampled + chosen,
                                   use_tqdm=False)
    for out in outputs[:4]:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    for out in outputs[4:]:
        assert out.outputs[0].text in choices


def test_grammar_ebnf_and_json_object(backend_llm):
    grammar = 'root ::= "x=" [0-9] [0-9]? ";"'
    obj_params = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(grammar=grammar)),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=obj_params)]
    ebnf, obj = backend_llm.generate(["Set x:", "An object:"], params, use_tqdm=False)
    assert re.fullmatch(r"x=[0-9][0-9]?;", ebnf.outputs[0].text)
    if obj.outputs[0].finish_reason == "stop":  # a free-form object may run past max_tokens
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    assert obj.outputs[0].text.startswith("{")


@pytest.mark.parametrize("constraint, field", [
    ({"json": {"type": "no-such-type"}}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
])
def test_a_constraint_the_backend_cannot_parse_is_refused_before_the_engine(
        backend_llm, constraint, field):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    core = backend_llm.llm_engine.engine_core
    compiles = core.grammar_compiler.num_compiles
    with pytest.raises(VLLMValidationError) as info:
        backend_llm.generate(["x"], params, use_tqdm=False)
    assert info.value.parameter == field
    assert core.grammar_compiler.num_compiles == compiles  # never reached the engine


def test_other_requests_step_while_a_grammar_compiles(bundled_llm, monkeypatch):
    """A compile held back by an event: the plain request produces all its tokens while
    the constrained one waits in WAITING_FOR_FSM; released, it finishes valid."""
    engine = bundled_llm.llm_engine
    core = engine.engine_core
    compiler = core.grammar_compiler
    release, started = threading.Event(), threading.Event()
    compile_now = compiler._compile

    def held_compile(params):
        started.set()
        assert release.wait(60)
        return compile_now(params)

    monkeypatch.setattr(compiler, "_compile", held_compile)
    # A schema no other test compiles (the cache would answer at once).
    held = StructuredOutputsParams(json={**SCHEMA, "title": "held"}, disable_any_whitespace=True)
    engine.add_request("held", PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      structured_outputs=held))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))
    assert started.wait(60)
    finished = {}
    while "plain" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert core.scheduler.requests["held"].status == RequestStatus.WAITING_FOR_FSM
    assert len(finished["plain"].outputs[0].token_ids) == 8
    release.set()
    while "held" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    jsonschema.validate(json.loads(finished["held"].outputs[0].text), SCHEMA)


@pytest.fixture(scope="module")
def ngram_llm():
    from vllm import LLM

    llm = LLM(**ENGINE_KWARGS, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    yield llm
    llm.llm_engine.shutdown()


def test_100_json_schema_replies_validate_with_ngram_speculation(ngram_llm):
    engine = ngram_llm.llm_engine
    # A prompt whose text the drafts copy: ngram proposes from it, and the grammar
    # refuses some of what it proposes.
    prompt = PROMPT + ' {"k": "bird", "o": {"a": "yes"}, "t": ["z"]} ' + PROMPT
    outputs = ngram_llm.generate([prompt] * NUM_REPLIES, _json_params(NUM_REPLIES),
                                 use_tqdm=False)
    _assert_all_validate(outputs)
    stats = engine.engine_core.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_json_schema_replies_validate_with_async_scheduling():
    """Async scheduling (the default on CUDA): the mask of step N+1 waits for step N's
    ids before advancing the matchers. Forced on here on the CPU."""
    from vllm import LLM

    llm = LLM(**ENGINE_KWARGS, async_scheduling=True)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        outputs = llm.generate([PROMPT] * 32, _json_params(32), use_tqdm=False)
        _assert_all_validate(outputs)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_100_json_schema_replies_validate_on_cuda_defaults(backend):
    """The GPU defaults (CUDA graphs, async scheduling): 100 of 100 validate."""
    from vllm import LLM

    llm = LLM(max_model_len=512, max_num_seqs=128,
              structured_outputs_config={"backend": backend})
    try:
        outputs = llm.generate([PROMPT] * NUM_REPLIES, _json_params(NUM_REPLIES),
                               use_tqdm=False)
        _assert_all_validate(outputs)
    finally:
        llm.llm_engine.shutdown()
