"""Async scheduling on CUDA: on by default, greedy outputs identical to the synchronous loop.

Random-weight Llama (fp32, CUDA graphs on). With ignore_eos and max_tokens
the two loops run the same batches step for step (async never schedules a
step past max_tokens), so the outputs must be equal token for token; the
same with a tiny cache (preemption) and with stop strings.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.model_dirs import llama_config, make_model_dir
from vllm import LLM, SamplingParams
from vllm.v1.worker.async_output import AsyncRunnerOutput

pytestmark = pytest.mark.cuda

PROMPTS = [{"prompt_token_ids": [0] + list(range(5, 5 + n))} for n in (3, 17, 40, 129, 250)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model_dir(tmp_path_factory.mktemp("async_cuda"), llama_config(), weights=True))


def _run(model_dir: str, async_scheduling: bool | None, max_tokens=(48, 7, 33, 48, 1), **kwargs):
    llm = LLM(model_dir, dtype="float32", gpu_memory_utilization=0.3,
              async_scheduling=async_scheduling, **{"max_model_len": 512, **kwargs})
    core = llm.llm_engine.engine_core
    runner = core.worker.model_runner
    kinds = []
    execute = runner.execute_model

    def spy(so):
        out = execute(so)
        kinds.append(type(out))
        return out

    runner.execute_model = spy
    greedy = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
              for m in max_tokens]
    first = llm.generate(PROMPTS, greedy, use_tqdm=False)
    stops = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                            stop=[o.outputs[0].text[len(o.outputs[0].text) // 2:][:3]] if
                            len(o.outputs[0].text) > 6 else None)
             for o in first]
    second = llm.generate(PROMPTS, stops, use_tqdm=False)
    result = {
        "tokens": [o.outputs[0].token_ids for o in first + second],
        "finish": [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in first + second],
        "async": core.async_scheduling,
        "async_outputs": AsyncRunnerOutput in kinds,
        "graphs": runner.cuda_graphs.captured,
        "preemptions": core.get_stats().num_preemptions,
        "usage": llm.llm_engine.get_scheduler_stats().kv_cache_usage,
    }
    llm.llm_engine.shutdown()
    del llm, runner, core
    gc.collect()
    torch.cuda.empty_cache()
    return result


def test_async_is_the_cuda_default_and_greedy_is_identical(model_dir):
    on = _run(model_dir, None)
    off = _run(model_dir, False)
    assert on["async"] and on["async_outputs"] and on["graphs"]
    assert not off["async"] and not off["async_outputs"]
    assert on["tokens"] == off["tokens"]
    assert on["finish"] == off["finish"]
    assert any(isinstance(stop, str) for _, stop in on["finish"])  # a stop string matched
    assert on["usage"] == 0  # every block came back, the dropped extra steps' too


def test_greedy_identical_with_preemption(model_dir):
    # 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB a block; 19
    # usable blocks for five sequences needing 39 (the longest 19): preempts.
    # max_model_len 304: what 19 usable blocks hold (longer fails the start-up, as in vLLM).
    small = dict(max_model_len=304, kv_cache_memory_bytes=20 * 8192, enable_prefix_caching=False,
                 enable_extensible_kv_cache=False)
    on = _run(model_dir, True, (48, 48, 48, 48, 1), **small)
    off = _run(model_dir, False, (48, 48, 48, 48, 1), **small)
    assert on["preemptions"] > 0 and off["preemptions"] > 0
    assert on["async_outputs"]
    assert on["tokens"] == off["tokens"]
    assert on["finish"] == off["finish"]


def _greedy_with_graph_ids(model_dir: str, use_graph_ids: bool) -> dict:
    """Greedy tokens with async scheduling on; counts the runner's eager lm_head calls
    and the steps that sampled from the decode graph's head."""
    from vllm.v1.sample.sampler import Sampler

    llm = LLM(model_dir, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    runner = llm.llm_engine.engine_core.worker.model_runner
    counts = {"eager_logits": 0, "graph_ids": 0}
    compute_logits, forward = runner.model.compute_logits, Sampler.forward

    def eager_logits(hidden):
        counts["eager_logits"] += 1
        return compute_logits(hidden)

    def sampler_forward(self, logits, md, greedy=None):
        counts["graph_ids"] += greedy is not None
        return forward(self, logits, md, greedy if use_graph_ids else None)

    runner.model.compute_logits = eager_logits
    Sampler.forward = sampler_forward
    try:
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                  for m in (48, 7, 33, 48, 1)]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        Sampler.forward = forward
    tokens = [o.outputs[0].token_ids for o in outs]
    llm.llm_engine.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens": tokens, **counts}


def test_decode_steps_sample_from_the_graph_head(model_dir):
    """A decode graph computes its rows' logits and greedy ids: decode steps launch no
    eager lm_head, and the ids equal the sampler's own argmax of the same logits while
    async scheduling copies them out behind the next step's replay."""
    graph = _greedy_with_graph_ids(model_dir, True)
    recomputed = _greedy_with_graph_ids(model_dir, False)
    assert graph["graph_ids"] > 40  # the decode steps of the 48-token requests
    assert graph["eager_logits"] < 10  # prefill (and mixed) steps only
    assert graph["graph_ids"] == recomputed["graph_ids"]
    assert graph["tokens"] == recomputed["tokens"]
