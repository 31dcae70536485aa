"""End-to-end on the bundled model (CPU; on CUDA too when a GPU is present).

Greedy output equals transformers on the same GGUF; outputs are identical
whether the cache is tiny (preemption) or large, with prefix caching on or
off, and between the classic and extensible KV paths; seeded sampling is
reproducible.
"""

from __future__ import annotations

import gc

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from vllm import LLM, SamplingParams
from vllm.transformers_utils.config import get_bundled_model_path
from vllm.v1.worker.kv_cache import ClassicKVCacheBuffers, ExtensibleKVCacheBuffers

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
# A shared prefix of more than two 16-token blocks, for prefix-cache hits.
SHARED = (
    "You are a helpful assistant. Answer briefly and precisely, and never "
    "invent facts you do not know. If a question is ambiguous, say which "
    "reading you answer. Keep every answer under twenty words. Question: "
)
PREFIX_PROMPTS = [SHARED + q for q in ("What is 2+2?", "Name a fruit.", "Who wrote Hamlet?")]
GREEDY = SamplingParams(max_tokens=20, temperature=0)
# The other engine differs from the shared one in everything outputs must not depend on:
# a tiny KV cache (6 usable blocks of 16 tokens: four ~30-token sequences cannot all fit,
# so it preempts), prefix caching off, and the classic (not extensible) KV path.
# max_model_len 96: what 6 blocks hold (a cache too small for one request of max_model_len
# fails the start-up, as in vLLM).
OTHER = dict(ENGINE_KWARGS, max_model_len=96, max_num_seqs=8,
             kv_cache_memory_bytes=7 * 16 * 30 * 2 * 3 * 64 * 4,
             enable_prefix_caching=False, enable_extensible_kv_cache=False)


def _texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def llm(bundled_llm):
    return bundled_llm


@pytest.fixture(scope="module")
def other_llm():
    engine = LLM(**OTHER)
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_greedy_equals_transformers_on_the_same_gguf(reference, bundled_hf_model):
    from transformers import AutoTokenizer

    path = get_bundled_model_path()
    directory, name = path.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = bundled_hf_model
    for prompt, out in zip(PROMPTS, reference, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == out.prompt_token_ids
        ref = hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :].tolist()
        n = len(out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == ref[:n]
    assert reference[0].outputs[0].text.startswith(" Paris")


def test_tiny_cache_preempts_and_gives_identical_outputs(other_llm, reference):
    assert other_llm.llm_engine.engine_core.num_blocks <= 8
    preemptions = other_llm.llm_engine.engine_core.get_stats().num_preemptions
    out = other_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert other_llm.llm_engine.engine_core.get_stats().num_preemptions > preemptions
    assert _texts(out) == _texts(reference)


def test_prefix_caching_on_and_off_identical_with_hits(llm, other_llm):
    hits_before = llm.llm_engine.engine_core.get_stats().prefix_cache_hits
    first = llm.generate(PREFIX_PROMPTS[:1], GREEDY, use_tqdm=False)
    cached = llm.generate(PREFIX_PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.engine_core.get_stats()
    shared_blocks = (len(llm.get_tokenizer().encode(SHARED)) - 1) // 16
    assert shared_blocks >= 2
    # Every prompt of the second batch reuses the shared blocks the first cached.
    assert stats.prefix_cache_hits - hits_before >= 3 * 16 * shared_blocks
    assert any(o.num_cached_tokens > 0 for o in cached)
    uncached = other_llm.generate(PREFIX_PROMPTS, GREEDY, use_tqdm=False)
    assert other_llm.llm_engine.engine_core.get_stats().prefix_cache_hits == 0
    assert _texts(cached) == _texts(uncached)
    assert _texts(first) == _texts(uncached)[:1]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, n=2)
    a = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [[c.text for c in o.outputs] for o in a] == [[c.text for c in o.outputs] for o in b]
    # n=2 children get different seeds: their texts differ.
    assert a[0].outputs[0].text != a[0].outputs[1].text
    # The same seeded request alone gives the same text as in a batch.
    alone = llm.generate(PROMPTS[1], params, use_tqdm=False)
    assert [c.text for c in alone[0].outputs] == [c.text for c in a[1].outputs]


def test_extensible_cache_grows_after_warmup_and_matches_classic(llm, other_llm, reference):
    worker = llm.llm_engine.engine_core.worker
    assert llm.llm_engine.engine_core.plan.extensible_kv_cache  # the start-up plan says so
    ext = worker.kv_cache
    assert isinstance(ext, ExtensibleKVCacheBuffers)
    # Warmup ran against the null block + one block; the cache grew after it.
    assert ext.committed_blocks == llm.llm_engine.engine_core.num_blocks > 2
    base = ext.tensor.full_view().data_ptr()
    first_layer = next(iter(ext.views.values()))
    assert first_layer.data_ptr() == base
    assert first_layer.shape[0] == ext.committed_blocks
    assert isinstance(other_llm.llm_engine.engine_core.worker.kv_cache, ClassicKVCacheBuffers)
    out = other_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _texts(out) == _texts(reference)


def test_stop_strings_logprobs_and_chat(llm):
    out = llm.generate(
        "List three colors:",
        SamplingParams(max_tokens=40, temperature=0, stop=["\n\n"], logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "\n\n"
    assert "\n\n" not in out.text and out.text.strip()
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert 2 <= len(entry) <= 3
    reply = (
        llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=16, temperature=0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert "Paris" in reply


def test_invalid_requests_are_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("hello " * (ENGINE_KWARGS["max_model_len"] + 10), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text.startswith(" Paris")


def test_max_tokens_past_max_model_len_stops_at_it(llm):
    """As in vLLM V1, offline: a prompt that fits is served whatever max_tokens says, and
    generation stops at max_model_len with finish_reason "length" (it raised here)."""
    prompt = {"prompt_token_ids": [28] * (ENGINE_KWARGS["max_model_len"] - 3)}
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_cpu_threads_follow_the_cpu_rules(llm):
    """On the CPU the engine's OpenMP team has one thread per physical core it may use
    (VLLM_CPU_OMP_THREADS_BIND=auto), not torch's default; with no reserve set, as many
    compute as the governor read idle at the last step (issue 48)."""
    import torch

    from vllm.platforms import current_platform
    from vllm.platforms.cpu_threads import plan_cpu_threads_from_env

    if current_platform.device_type != "cpu":
        pytest.skip("host threads are chosen on the CPU platform only")
    plan = plan_cpu_threads_from_env()
    assert plan.num_threads is not None
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    governor = current_platform.thread_governor
    assert (governor is not None) == plan.adaptive
    if governor is None:
        assert torch.get_num_threads() == plan.num_threads
    else:
        assert 1 <= torch.get_num_threads() == governor.num_threads <= plan.num_threads


def test_a_batch_of_long_prompts_starts_in_one_step(llm, monkeypatch):
    """A batch of prompts over the long-prompt threshold (4 % of max_model_len = 20 tokens)
    that fits the step budget is prefilled in one step and then decodes together: one step per
    output token (issue 10: the engine admitted one such prompt a step, so a batch of 32 took
    31 extra mixed steps, run without CUDA graphs; batch-32 throughput fell 4x)."""
    import random

    scheduler = llm.llm_engine.engine_core.scheduler
    counts: list[int] = []
    schedule = scheduler.schedule

    def counting_schedule():
        output = schedule()
        counts.append(len(output.num_scheduled_tokens))
        return output

    monkeypatch.setattr(scheduler, "schedule", counting_schedule)
    rng = random.Random(10)  # unique token ids: no prefix-cache hits from other tests
    prompts = [{"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(30)]}
               for _ in range(4)]  # 4 x 30 tokens <= the 128-token budget, each one long
    outputs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3, 3]
    assert counts == [4, 4, 4]
