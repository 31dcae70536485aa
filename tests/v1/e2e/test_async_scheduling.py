"""Async scheduling end to end on the CPU: outputs identical to the synchronous loop.

The CPU has nothing to overlap (default off there), but the mechanism is the
same as on CUDA: the next step is scheduled before the last one's tokens
reach the scheduler, the runner feeds the sampled ids from its device tensor
into the next step's input ids, and host placeholders are filled later. The
bundled model runs against the session's synchronous engine; a random-weight
Llama runs both ways. Both with preemption (tiny caches) and stop strings.
"""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from tests.model_dirs import llama_config, make_model_dir
from tests.v1.e2e.utils import shutdown_llm
from vllm import LLM, SamplingParams
from vllm.v1.worker.async_output import AsyncRunnerOutput

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
# As tests/v1/e2e/test_offline_engine.py's other engine: 6 usable blocks, it preempts.
# max_model_len 96: what 6 blocks hold (a longer one fails the start-up, as in vLLM).
TINY_CACHE = dict(ENGINE_KWARGS, max_model_len=96, max_num_seqs=8,
                  kv_cache_memory_bytes=7 * 16 * 30 * 2 * 3 * 64 * 4,
                  enable_prefix_caching=False, enable_extensible_kv_cache=False)
MIXED = [
    SamplingParams(max_tokens=16, temperature=0),
    SamplingParams(max_tokens=24, temperature=0, stop=["."]),  # a stop string
    SamplingParams(max_tokens=3, temperature=0),  # capped while others run on
    SamplingParams(max_tokens=8, temperature=0, logprobs=2, repetition_penalty=1.3),
]


def _results(outputs):
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
         o.outputs[0].stop_reason)
        for o in outputs
    ]


@pytest.fixture(scope="module")
def async_llm():
    llm = LLM(**TINY_CACHE, async_scheduling=True)
    yield llm
    shutdown_llm(llm)


def test_bundled_model_greedy_identical_with_preemption(async_llm, bundled_llm):
    core = async_llm.llm_engine.engine_core
    assert core.async_scheduling and core.worker.model_runner.async_state is not None
    assert not bundled_llm.llm_engine.engine_core.async_scheduling  # CPU default
    preemptions = core.get_stats().num_preemptions
    runner = core.worker.model_runner
    seen = []
    execute = runner.execute_model

    def spy(so):
        out = execute(so)
        seen.append(type(out))
        return out

    runner.execute_model = spy
    try:
        params = SamplingParams(max_tokens=16, temperature=0)
        got = async_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del runner.execute_model
    assert core.get_stats().num_preemptions > preemptions
    assert AsyncRunnerOutput in seen  # the steps really went through the async path
    want = bundled_llm.generate(PROMPTS, params, use_tqdm=False)
    assert _results(got) == _results(want)


def test_bundled_model_stop_strings_caps_logprobs_penalties(async_llm, bundled_llm):
    got = async_llm.generate(PROMPTS, MIXED, use_tqdm=False)
    want = bundled_llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert _results(got) == _results(want)
    assert got[1].outputs[0].stop_reason == "."  # " red, blue, and green" stopped at "."
    assert not got[1].outputs[0].text.endswith(".")
    assert [len(got[i].outputs[0].token_ids) for i in (0, 2)] == [16, 3]
    # Logprobs of the same tokens (batch composition may differ: rounding only).
    for g, w in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs, strict=True):
        assert g.keys() == w.keys()
        for token_id, lp in g.items():
            assert lp.logprob == pytest.approx(w[token_id].logprob, abs=1e-4)
    # Nothing left behind: the dropped extra steps freed their blocks.
    assert not async_llm.llm_engine.has_unfinished_requests()
    assert async_llm.llm_engine.get_scheduler_stats().kv_cache_usage == 0


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    return str(make_model_dir(tmp_path_factory.mktemp("async_llama"), llama_config(),
                              weights=True))


def test_random_weights_sync_and_async_identical_with_preemption_and_stops(random_llama):
    prompts = [{"prompt_token_ids": [0] + list(range(5, 5 + n))} for n in (3, 17, 40, 9)]
    # 7 usable blocks of 16 tokens (2 layers x K,V x 16 x 2 heads x 16 x 4 bytes each)
    # for four sequences of up to 90 tokens (6 blocks): it preempts.
    # max_model_len 112: what 7 blocks hold (a longer one fails the start-up, as in vLLM).
    kwargs = dict(model=random_llama, dtype="float32", max_model_len=112, max_num_seqs=4,
                  max_num_batched_tokens=32, block_size=16, enable_prefix_caching=False,
                  enable_extensible_kv_cache=False, kv_cache_memory_bytes=8 * 8192)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(**kwargs, async_scheduling=async_scheduling)
        core = llm.llm_engine.engine_core
        assert core.num_blocks == 8
        greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        first = llm.generate(prompts, greedy, use_tqdm=False)
        # Stop strings taken from the middle of each greedy text: both loops must cut there.
        stops = [
            SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                           stop=[o.outputs[0].text[len(o.outputs[0].text) // 2:][:3]])
            for o in first
        ]
        second = llm.generate(prompts, stops, use_tqdm=False)
        runs[async_scheduling] = (_results(first), _results(second),
                                  core.get_stats().num_preemptions)
        shutdown_llm(llm)
    assert runs[True][2] > 0 and runs[False][2] > 0
    assert runs[True][:2] == runs[False][:2]
    assert any(isinstance(r[3], str) for r in runs[True][1])  # some stop string matched
