"""`GrammarBitmask` (the runner's matchers) and the sampler's bitmask, on a tiny vocabulary.

Real xgrammar and llguidance matchers (each test runs with both backends) over a
five-token raw vocabulary and the regex "ab+c":
the mask of each row is what the grammar allows next, drafts get one row per
position (a draft the grammar refuses is then rejected by the rejection
sampler, and the matcher is rolled back), EOS is allowed only at the end, and
the sampler never samples a refused token.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch

from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.sample.metadata import build_sampling_metadata
from vllm.v1.sample.ops.bitmask import apply_bitmask
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output import CompiledGrammar, backend_tokenizers, guidance
from vllm.v1.structured_output.backend_tokenizers import BackendTokenizer, TokenizerKey
from vllm.v1.structured_output.reasoning import ReasoningTokens
from vllm.v1.worker.grammar_bitmask import GrammarBitmask

xgr = pytest.importorskip("xgrammar")

EOS, A, B, C, X, THINK, END = range(7)
VOCAB = ["</s>", "a", "b", "c", "x", "<think>", "</think>"]


@dataclass
class State:  # the fields of CachedRequestState the bitmask reads
    req_id: str
    output_token_ids: list[int] = field(default_factory=list)


class _RawTokenizer:
    """llguidance's view of VOCAB (what `llguidance.TokenizerWrapper` reads)."""

    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS, THINK, END]
    tokens = [b"\xff[0]", *(t.encode() for t in VOCAB[1:5]), b"\xff[5]", b"\xff[6]"]

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        return [VOCAB.index(ch) if ch in VOCAB else X for ch in text]


def _seed_tokenizer(monkeypatch, backend: str, info) -> TokenizerKey:
    """Put a backend's tokenizer over VOCAB into this process's builds under a made-up
    path (a pickled grammar finds it there too, as a worker process finds its model's)."""
    key = TokenizerKey(backend, "raw-vocab", len(VOCAB), (EOS,))
    future = Future()
    future.set_result(BackendTokenizer(None, info, frozenset({EOS}), 0.0))
    monkeypatch.setitem(backend_tokenizers._BUILDS, key, future)
    return key


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def grammar(request, monkeypatch_module):
    if request.param == "xgrammar":
        info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
        key = _seed_tokenizer(monkeypatch_module, "xgrammar", info)
        return CompiledGrammar(xgr.GrammarCompiler(info).compile_regex("ab+c"), key)
    llg = pytest.importorskip("llguidance")
    key = _seed_tokenizer(monkeypatch_module, "guidance",
                          llg.LLTokenizer(llg.TokenizerWrapper(_RawTokenizer())))
    text = guidance.build_guidance_grammar(StructuredOutputsParams(regex="ab+c"))
    return guidance.GuidanceGrammar(key, text)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _allowed(bitmask: torch.Tensor) -> list[set[int]]:
    logits = torch.zeros(bitmask.shape[0], len(VOCAB))
    apply_bitmask(logits, bitmask)
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]


def test_each_row_allows_what_the_grammar_allows_next(grammar):
    masks = GrammarBitmask(max_rows=4, vocab_size=len(VOCAB), device=torch.device("cpu"))
    masks.add("r", grammar)
    state, plain = State("r"), State("plain")
    assert masks.bitmask([plain]) is None  # no constrained row: no mask at all
    assert _allowed(masks.bitmask([state, plain])) == [{A}, set(range(len(VOCAB)))]
    state.output_token_ids += [A]
    assert _allowed(masks.bitmask([state])) == [{B}]
    state.output_token_ids += [B]
    assert _allowed(masks.bitmask([state])) == [{B, C}]
    state.output_token_ids += [C]
    assert _allowed(masks.bitmask([state])) == [{EOS}]  # EOS only where the grammar ends
    state.output_token_ids += [EOS]  # terminated: ignore_eos goes on unconstrained (vLLM)
    assert _allowed(masks.bitmask([state])) == [set(range(len(VOCAB)))]
    masks.remove(["r"])
    assert masks.bitmask([state]) is None


def test_draft_rows_and_a_refused_draft_is_rejected(grammar):
    masks = GrammarBitmask(max_rows=8, vocab_size=len(VOCAB), device=torch.device("cpu"))
    masks.add("r", grammar)
    state = State("r", [A])
    drafts = [B, X, C]  # X is refused after "ab"
    bitmask = masks.bitmask([state], [drafts])
    everything = set(range(len(VOCAB)))
    assert _allowed(bitmask) == [{B}, {B, C}, everything, everything]
    # The target's argmax is each draft (X at position 1), C second best there.
    logits = torch.full((4, len(VOCAB)), -5.0)
    for pos, tok in enumerate([B, X, C, EOS]):
        logits[pos, tok] = 5.0
    logits[1, C] = 4.0
    params = [SamplingParams(temperature=0)] * 4
    md = build_sampling_metadata(params, [[0]] * 4, [[] for _ in params], {}, len(VOCAB), "cpu")
    unmasked = RejectionSampler()([drafts], logits.clone(), md, {})
    assert unmasked == [[B, X, C, EOS]]  # without the grammar every draft is taken
    apply_bitmask(logits, bitmask)
    assert RejectionSampler()([drafts], logits, md, {}) == [[B, C]]
    # The matcher was rolled back: the next mask is still the one after "a".
    assert _allowed(masks.bitmask([state])) == [{B}]


def test_the_sampler_never_samples_a_refused_token(grammar):
    masks = GrammarBitmask(max_rows=4, vocab_size=len(VOCAB), device=torch.device("cpu"))
    masks.add("r", grammar)
    state = State("r", [A])
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]] * 2)  # raw argmax: C
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    md = build_sampling_metadata(params, [[0]] * 2, [[A], [A]], {}, len(VOCAB), "cpu")
    md.grammar_bitmask = masks.bitmask([state, state])
    for _ in range(5):
        out = Sampler()(logits.clone(), md)
        assert out.sampled_token_ids.tolist() == [B, B]


def _thinking(grammar):
    """The same grammar, applied after Qwen3-style reasoning (`--reasoning-parser qwen3`)."""
    tokens = ReasoningTokens(THINK, END, starts_in_reasoning=False, whitespace_ids=frozenset())
    if isinstance(grammar, CompiledGrammar):
        return CompiledGrammar(grammar.grammar, grammar.tokenizer, tokens)
    return guidance.GuidanceGrammar(grammar.tokenizer, grammar.grammar, tokens)


def test_with_a_reasoning_parser_the_grammar_applies_after_the_reasoning(grammar):
    everything = set(range(len(VOCAB)))
    masks = GrammarBitmask(max_rows=8, vocab_size=len(VOCAB), device=torch.device("cpu"))
    masks.add("r", _thinking(grammar), prompt_token_ids=[X, A])
    state = State("r")
    # The first token may open the reasoning, or be the answer's first (the grammar's).
    assert _allowed(masks.bitmask([state])) == [{A, THINK}]
    state.output_token_ids += [THINK, X, C]  # reasoning: anything goes
    assert _allowed(masks.bitmask([state])) == [everything]
    state.output_token_ids += [END]  # the grammar starts after the end tag
    assert _allowed(masks.bitmask([state])) == [{A}]
    state.output_token_ids += [A]
    assert _allowed(masks.bitmask([state])) == [{B}]
    # Drafts through the reasoning: free up to the drafted end tag, the grammar after it.
    masks.add("d", _thinking(grammar), prompt_token_ids=[X])
    rows = _allowed(masks.bitmask([State("d")], [[THINK, X, END, A, X]]))
    assert rows == [{A, THINK}, everything, everything, {A}, {B}, everything]
    # A prompt that closed the reasoning (enable_thinking: false): the grammar at once;
    # a first token that is not the start tag is the answer's.
    masks.add("closed", _thinking(grammar), prompt_token_ids=[X, THINK, END])
    masks.add("direct", _thinking(grammar), prompt_token_ids=[X])
    direct = State("direct", [A])
    assert _allowed(masks.bitmask([State("closed"), direct])) == [{A}, {B}]


def test_a_bitmask_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        apply_bitmask(torch.zeros(2, 40), torch.zeros(2, 1, dtype=torch.int32))


def test_a_compiled_grammar_pickles_for_worker_processes(grammar, monkeypatch):
    """Worker processes (mp / ray executors) get the grammar pickled: xgrammar's JSON, or
    llguidance's grammar text, with the tokenizer's key; the worker's own tokenizer for
    that key (built once per process) serves every grammar: none is rebuilt per grammar
    (xgrammar's TokenizerInfo JSON is 4 MiB for a 128k vocabulary)."""
    import pickle

    def no_rebuild(*args):
        raise AssertionError("a tokenizer was rebuilt for a grammar")

    monkeypatch.setattr(xgr.TokenizerInfo, "deserialize_json", no_rebuild)
    monkeypatch.setattr(backend_tokenizers, "_build", no_rebuild)
    payload = pickle.dumps(grammar)
    assert b"raw-vocab" in payload and b"</think>" not in payload  # the key, not the vocab
    copies = [pickle.loads(payload) for _ in range(3)]
    masks = GrammarBitmask(max_rows=2, vocab_size=len(VOCAB), device=torch.device("cpu"))
    for i, copy in enumerate(copies):
        assert copy.tokenizer == grammar.tokenizer
        masks.add(f"r{i}", copy)
        assert _allowed(masks.bitmask([State(f"r{i}", [A, B])])) == [{B, C}]


@pytest.mark.cuda
def test_cuda_bitmask_matches_the_cpu_on_odd_shapes(grammar):
    """xgrammar's device kernel against its CPU path, over odd vocabulary widths and rows
    (float32 and bfloat16 logits), and the runner's mask copied to the device."""
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 33), (3, 1000), (32, 128256), (7, 49153)]:
        bits = torch.randint(-(2**31), 2**31 - 1, (rows, -(-vocab // 32)), generator=gen,
                             dtype=torch.int64).to(torch.int32)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(rows, vocab, generator=gen).to(dtype)
            expected = logits.clone()
            apply_bitmask(expected, bits)
            on_device = logits.cuda()
            apply_bitmask(on_device, bits.cuda())
            assert torch.equal(on_device.cpu(), expected)
    masks = GrammarBitmask(max_rows=2, vocab_size=len(VOCAB), device=torch.device("cuda"))
    masks.add("r", grammar)
    bitmask = masks.bitmask([State("r", [A])])
    assert bitmask.is_cuda and _allowed(bitmask.cpu()) == [{B}]
