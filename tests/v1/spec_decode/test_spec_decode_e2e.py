"""Speculative decoding end to end on CPU: greedy output identical to no speculation.

The bundled model (real text, prompts that quote their input so drafts are
accepted) and a random-weight Llama shape; seeded sampling is reproducible.
"""

import gc

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from tests.model_dirs import llama_config, make_model_dir
from vllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
QUOTING = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox "
    "jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def spec_llm():
    engine = LLM(speculative_config=NGRAM, **ENGINE_KWARGS)
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _spec_stats(llm):
    return llm.llm_engine.get_scheduler_stats().spec_decoding_stats.copy()


def test_greedy_identical_to_no_speculation_bundled(spec_llm, bundled_llm):
    before = _spec_stats(spec_llm)
    ref = bundled_llm.generate(QUOTING, GREEDY, use_tqdm=False)
    out = spec_llm.generate(QUOTING, GREEDY, use_tqdm=False)
    assert _ids(out) == _ids(ref)
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    delta = _spec_stats(spec_llm).minus(before)
    # Drafts were verified and accepted (the quoting prompts repeat themselves),
    # and acceptance per position never increases with the position.
    assert delta.num_drafts > 0 and delta.num_accepted_tokens > 0
    assert delta.num_accepted_tokens <= delta.num_draft_tokens <= 4 * delta.num_drafts
    per_pos = delta.num_accepted_tokens_per_pos
    assert sum(per_pos) == delta.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    # Fewer steps than tokens: some steps emitted several tokens.
    num_tokens = sum(len(t) for t in _ids(out))
    assert delta.num_drafts + delta.num_accepted_tokens <= num_tokens


def test_stop_string_and_max_tokens_after_acceptance(spec_llm, bundled_llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["lazy"])
    ref = bundled_llm.generate(QUOTING[:1], params, use_tqdm=False)[0].outputs[0]
    out = spec_llm.generate(QUOTING[:1], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (
        ref.text, ref.finish_reason, ref.stop_reason
    )
    assert out.finish_reason == "stop"
    short = SamplingParams(temperature=0.0, max_tokens=7)
    out = spec_llm.generate(QUOTING[:1], short, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_seeded_sampling_reproducible(spec_llm):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=16) for s in (1, 1, 2)]
    prompts = [QUOTING[0]] * 3
    first = _ids(spec_llm.generate(prompts, params, use_tqdm=False))
    second = _ids(spec_llm.generate(prompts, params, use_tqdm=False))
    assert first == second
    assert first[0] == first[1]  # same seed, same batch step: same tokens


def test_greedy_identical_on_random_weights_with_preemption(tmp_path_factory):
    """A random-weight Llama shape; a KV cache of 10 blocks for 3 requests of 5 blocks each,
    so requests are preempted (and recomputed) while drafts are in flight."""
    model_dir = make_model_dir(
        tmp_path_factory.mktemp("spec_llama"), llama_config(vocab_size=256), weights=True
    )
    # max_model_len 144: what 9 usable blocks hold (longer fails the start-up, as in vLLM).
    kwargs = dict(max_model_len=144, max_num_seqs=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=10 * 8192)  # 16 tokens x 2 layers x 2 x 2 x 16 x 4 B
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 4 + [5, 6]},
               {"prompt_token_ids": [30, 31, 32, 30, 31, 32, 30] * 3},
               {"prompt_token_ids": [40, 41, 42, 43] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    for spec in (None, NGRAM):
        engine = LLM(str(model_dir), speculative_config=spec, **kwargs)
        outs.append(_ids(engine.generate(prompts, params, use_tqdm=False)))
        stats = engine.llm_engine.get_scheduler_stats()
        assert stats.num_blocks == 10 and stats.num_preemptions > 0
        if spec:
            assert stats.spec_decoding_stats.num_drafts > 0
        engine.llm_engine.shutdown()
    assert outs[0] == outs[1]


def test_requests_speculation_does_not_serve_get_no_drafts(spec_llm, bundled_llm):
    """Penalties and logprobs are not applied by the verification: such requests decode
    one token a step, with the same output as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, logprobs=2)
    before = _spec_stats(spec_llm)
    out = spec_llm.generate(QUOTING[:1], params, use_tqdm=False)[0].outputs[0]
    ref = bundled_llm.generate(QUOTING[:1], params, use_tqdm=False)[0].outputs[0]
    assert _spec_stats(spec_llm).minus(before).num_drafts == 0
    assert out.token_ids == ref.token_ids and len(out.logprobs) == 12


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_inside_accepted_drafts_ends_token_ids(spec_llm, bundled_llm, include_stop):
    """Several accepted tokens arrive in one step and a stop string ends among them: the
    output ends at the token that completes the stop string (token_ids, hence usage), as
    without speculation."""
    prompt = "one two three four " * 4 + "one two"
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=["four one"],
                            include_stop_str_in_output=include_stop)
    before = _spec_stats(spec_llm)
    ref = bundled_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert _spec_stats(spec_llm).minus(before).num_accepted_tokens > 0
    assert ref.finish_reason == "stop" and ref.stop_reason == "four one"
    assert (out.text, out.finish_reason, out.stop_reason) == (
        ref.text, ref.finish_reason, ref.stop_reason
    )
    assert out.token_ids == ref.token_ids


class _EagerGraphs:
    """What the runner's CUDAGraphManager does, run eagerly: replay(B) is the capture
    target's forward of B rows from the persistent buffers (no graphs on the CPU)."""

    def __init__(self, sizes, forward):
        self.capture_sizes, self._forward = sizes, forward
        self.num_replays = 0

    def padded_size(self, num_reqs):
        return next((size for size in self.capture_sizes if size >= num_reqs), None)

    def replay(self, size):
        self.num_replays += 1
        return self._forward(size)


def test_short_drafts_run_as_verify_rows_with_identical_output(spec_llm, bundled_llm,
                                                               monkeypatch):
    """Batches whose requests carry 0..k drafts (ngram drafts are short or absent) take
    the verify graph's layout, rows of k + 1 tokens with padding, instead of running
    eagerly; the greedy output is the same as without speculation."""
    runner = spec_llm.llm_engine.engine_core.worker.model_runner
    verify_rows = runner.verify_rows
    q = verify_rows.query_len
    # Every batch size "captured": padded requests (seq_len 0 with q query tokens) are
    # for the Triton kernel only; the CPU reference attention rejects them.
    graphs = _EagerGraphs(list(range(1, 9)), lambda size: runner._graph_forward(size, q))
    laid_out = []
    lay_out = verify_rows.lay_out

    def counting_lay_out(num_sched):
        laid_out.append(num_sched.tolist())
        return lay_out(num_sched)

    monkeypatch.setattr(runner, "use_cuda_graph", True)
    monkeypatch.setattr(runner, "cuda_graphs", _EagerGraphs([], None))  # decode: eager
    monkeypatch.setattr(verify_rows, "graphs", graphs)
    monkeypatch.setattr(verify_rows, "lay_out", counting_lay_out)
    ref = bundled_llm.generate(QUOTING, GREEDY, use_tqdm=False)
    out = spec_llm.generate(QUOTING, GREEDY, use_tqdm=False)
    assert _ids(out) == _ids(ref)
    # Rows with fewer than k + 1 tokens were padded, and every such batch replayed.
    assert laid_out and all(max(n) <= q and sum(n) < len(n) * q for n in laid_out)
    assert graphs.num_replays >= len(laid_out)
