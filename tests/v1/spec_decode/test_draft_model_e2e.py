"""method draft_model on CPU: the draft's layers share the target's KV blocks, greedy output
identical to no speculation (bundled model as its own draft; random-weight shapes with a
different draft, under preemption), seeded sampling reproducible, vocabulary checked."""

import gc

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from tests.model_dirs import llama_config, make_model_dir
from vllm import LLM, SamplingParams
from vllm.transformers_utils.config import get_bundled_model_path

PROMPTS = ["The capital of France is", "Write a short poem about the sea:"]


@pytest.fixture(scope="module")
def draft_llm():
    spec = {"method": "draft_model", "model": get_bundled_model_path(),
            "num_speculative_tokens": 3}
    engine = LLM(speculative_config=spec, **ENGINE_KWARGS)
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


def test_self_draft_greedy_identical_and_accepted(draft_llm, bundled_llm):
    runner = draft_llm.llm_engine.engine_core.worker.model_runner
    specs = runner.get_kv_cache_specs(runner.dtype)
    draft_layers = [n for n in specs if n.startswith("draft.")]
    assert len(draft_layers) == len(specs) // 2 == 30  # one layout for target and draft
    before = draft_llm.llm_engine.get_scheduler_stats().spec_decoding_stats.copy()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    out = draft_llm.generate(PROMPTS, params, use_tqdm=False)
    ref = bundled_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    delta = draft_llm.llm_engine.get_scheduler_stats().spec_decoding_stats.minus(before)
    # The same weights propose what the target picks: (nearly) every draft is accepted.
    assert delta.num_drafts > 0 and delta.acceptance_rate > 0.9


def test_self_draft_seeded_sampling_reproducible(draft_llm):
    params = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=10)
    first = [o.outputs[0].token_ids for o in draft_llm.generate(PROMPTS, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in draft_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert first == again


def test_random_weights_other_draft_with_preemption(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_model_dir(root / "target", llama_config(vocab_size=256), weights=True)
    draft = make_model_dir(root / "draft", llama_config(vocab_size=256, num_hidden_layers=1),
                           weights=True, seed=1)
    # 3 layers of KV per block now (2 target + 1 draft): 16 tokens x 3 x 2 x 2 x 16 x 4 B.
    # max_model_len 176: what 11 usable blocks hold (longer fails the start-up, as in vLLM).
    kwargs = dict(max_model_len=176, max_num_seqs=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=12 * 12288)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 4},
               {"prompt_token_ids": [30, 31, 32] * 7},
               {"prompt_token_ids": [40, 41, 42, 43] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "draft_model", "model": str(draft),
                        "num_speculative_tokens": 3}):
        engine = LLM(str(target), speculative_config=spec, **kwargs)
        outs.append([o.outputs[0].token_ids
                     for o in engine.generate(prompts, params, use_tqdm=False)])
        stats = engine.llm_engine.get_scheduler_stats()
        if spec:
            assert stats.num_blocks == 12 and stats.num_preemptions > 0
            assert stats.spec_decoding_stats.num_drafts > 0
        engine.llm_engine.shutdown()
    assert outs[0] == outs[1]


def test_draft_with_another_vocabulary_is_refused(tmp_path_factory):
    draft = make_model_dir(tmp_path_factory.mktemp("draft_vocab"), llama_config(vocab_size=300),
                           weights=False)
    target = make_model_dir(tmp_path_factory.mktemp("target_vocab"),
                            llama_config(vocab_size=256), weights=False)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        LLM(str(target), load_format="dummy", kv_cache_memory_bytes=2**20,
            speculative_config={"method": "draft_model", "model": str(draft),
                                "num_speculative_tokens": 2})
