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
    llm = LLM(model_dir, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3,
              async_scheduling=async_scheduling, **kwargs)
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
    small = dict(kv_cache_memory_bytes=20 * 8192, enable_prefix_caching=False,
                 enable_extensible_kv_cache=False)
    on = _run(model_dir, True, (48, 48, 48, 48, 1), **small)
    off = _run(model_dir, False, (48, 48, 48, 48, 1), **small)
    assert on["preemptions"] > 0 and off["preemptions"] > 0
    assert on["async_outputs"]
    assert on["tokens"] == off["tokens"]
    assert on["finish"] == off["finish"]
