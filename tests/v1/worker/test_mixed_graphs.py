"""Mixed-batch graphs' padding (mixed_graphs.py) on the CPU, where it runs eagerly.

Two CPU engines on the same tiny fp32 Llama weights run the same greedy
workload (prompts of several lengths, chunked prefill beside decodes): one
eager as a CPU engine is, one whose runner pads every step of <= 32 tokens
to a bucket (8, 16 or 32 tokens, up to min(bucket, max_num_seqs) requests)
the way a captured mixed graph replays it, with synchronous and with async
scheduling (whose previous-step ids are written into the padded buffers on the
device). Same tokens, and the same KV cache after the run (allclose: the
padded matmuls have other row counts), so padded rows wrote nothing; the null
block stays zero.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from tests.model_dirs import llama_config, make_model_dir

PROMPTS = [[0] + [5 + (i * 13 + j) % 400 for j in range(n)] for i, n in enumerate(
    (2, 6, 11, 23, 40, 3, 17))]
BUCKETS = [8, 16, 32]


def _engine(model_dir, async_scheduling: bool = False):
    from vllm import LLM

    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=48, enable_prefix_caching=False,
              async_scheduling=async_scheduling)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
    return llm


def _run(llm) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    runner = llm.llm_engine.engine_core.worker.model_runner
    caches = {name: view.clone() for name, view in runner.kv_caches.items()}
    return [list(o.outputs[0].token_ids) for o in outs], caches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"), llama_config(), weights=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The eager engine's tokens and KV cache (a CPU engine pads nothing)."""
    llm = _engine(model_dir)
    result = _run(llm)
    assert llm.llm_engine.engine_core.worker.model_runner.mixed.num_padded_steps == 0
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return result


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_mixed_steps_match_eager_and_write_no_kv(model_dir, reference, async_scheduling,
                                                        monkeypatch):
    from vllm.v1.worker.mixed_graphs import MixedBatchGraphs

    want_tokens, want_caches = reference
    llm = _engine(model_dir, async_scheduling)
    runner = llm.llm_engine.engine_core.worker.model_runner
    mixed = MixedBatchGraphs(BUCKETS, runner.max_num_reqs, runner.max_num_tokens,
                             runner._graph_forward, use_graphs=False)
    monkeypatch.setattr(runner, "mixed", mixed)
    sizes: list[int] = []
    run = mixed.run
    monkeypatch.setattr(mixed, "run", lambda size: (sizes.append(size), run(size))[1])
    tokens, caches = _run(llm)
    llm.llm_engine.shutdown()

    assert tokens == want_tokens
    # Every bucket served a step (some of them decodes beside prefill chunks), and
    # steps above 32 tokens ran eagerly (the 40-token prompt's first chunk: 48).
    assert set(sizes) == set(BUCKETS), sizes
    assert mixed.num_padded_steps == len(sizes) >= 10
    assert caches.keys() == want_caches.keys()
    for name, cache in caches.items():
        torch.testing.assert_close(cache, want_caches[name], rtol=1e-5, atol=1e-5)
        assert not cache[0].any(), f"{name}: the null block was written"
        assert cache[1:].abs().sum() > 0  # the workload wrote real keys


def test_upload_pads_a_mixed_step():
    from vllm.v1.worker.step_buffers import StepBuffers

    buf = StepBuffers(max_num_tokens=32, max_num_reqs=8, device=torch.device("cpu"),
                      pin_memory=False)
    buf.slot_mapping_np[:] = 7  # stale values from an earlier step
    buf.seq_lens_np[:] = 9
    cu = np.array([5, 6, 7])
    buf.upload(3, 7, 16, np.arange(1, 8), np.arange(7), np.arange(100, 107), cu,
               np.array([5, 20, 30]), end_reqs=8)
    assert buf.input_ids[:16].tolist() == [1, 2, 3, 4, 5, 6, 7] + [0] * 9
    assert buf.positions[7:16].tolist() == [0] * 9
    assert buf.slot_mapping[:16].tolist() == list(range(100, 107)) + [-1] * 9
    assert buf.query_start_loc.tolist() == [0, 5, 6, 7, 7, 7, 7, 7, 7]
    assert buf.seq_lens.tolist() == [5, 20, 30, 0, 0, 0, 0, 0]


def test_buckets_and_request_counts():
    from vllm.v1.worker.mixed_graphs import MixedBatchGraphs

    graphs = MixedBatchGraphs([64, 16, 512, 32], max_num_reqs=20, max_num_tokens=256,
                              forward=lambda r, q, t: torch.zeros(t, 1), use_graphs=False)
    assert graphs.sizes == [16, 32, 64]  # 512 is above the token buffers
    assert [graphs.bucket(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, None]
    assert [graphs.num_reqs(t) for t in graphs.sizes] == [16, 20, 20]
    captured = MixedBatchGraphs([16], 8, 256, lambda r, q, t: torch.zeros(t, 1), True)
    assert captured.bucket(4) is None  # until captured, steps run eagerly
