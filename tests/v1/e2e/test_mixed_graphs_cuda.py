"""Mixed-batch CUDA graphs (vllm/v1/worker/mixed_graphs.py) on the GPU.

Steps with prefill chunks of <= 256 tokens replay whole-step graphs captured
at start-up; `cudagraph_mode="FULL_DECODE_ONLY"` runs the same steps eagerly
(decode graphs in both). fp32 (IEEE in the attention kernel) on both sides,
same random weights: the greedy tokens are equal, up to exact near-ties (a
replay launches attention with the bucket's bounds, so its split of the key
range, and the order of the fp32 sums, differs from the eager launch's). A
graph captured against the extensible cache's small warmup prefix still
writes the right blocks once the cache has grown under it (all of the
workload's blocks lie past that prefix), and start-up captures one set of
graphs, never more.
"""

from __future__ import annotations

import pytest

from tests.model_dirs import make_model_dir, smollm2_config
from tests.v1.e2e.utils import shutdown_llm
from vllm import LLM, SamplingParams
from vllm.config.compilation import MIXED_CAPTURE_SIZES
from vllm.v1.worker.cuda_graph import CUDAGraphManager

FULL = {"cudagraph_mode": "FULL"}  # the default, named so the test says what it compares

pytestmark = pytest.mark.cuda

# Lengths 1..300: every bucket, and one prompt above the largest (eager).
PROMPTS = [[0] + [5 + (i * 7 + j) % 400 for j in range(n - 1)]
           for i, n in enumerate((1, 7, 15, 16, 17, 31, 40, 63, 100, 129, 250, 300))]


def _greedy(llm: LLM, prompts, max_tokens: int | None = None) -> list[tuple[list, list]]:
    """Greedy ids and each position's top-2 logprobs; `max_tokens` None: 4..16 tokens,
    different per prompt, so requests finish at different steps and the next
    prompts prefill beside decodes."""
    params = [SamplingParams(max_tokens=max_tokens or 4 + (i * 5) % 13, temperature=0,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _assert_same_up_to_ties(got, want) -> None:
    """Equal ids, but where a sequence first differs both tokens must be the reference's
    top two with logprobs within 1e-3 (a tie the sum order decides); most are exact."""
    exact = 0
    for (ids, _), (ref, ref_logprobs) in zip(got, want, strict=True):
        if ids == ref:
            exact += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(ids, ref, strict=True)) if a != b)
        top = {tok: lp.logprob for tok, lp in ref_logprobs[i].items()}
        assert ids[i] in top, f"token {i}: {ids[i]} is not in the reference's top 2 {top}"
        assert abs(top[ids[i]] - top[ref[i]]) < 1e-3, f"token {i}: no tie, {top}"
    assert exact >= len(want) - max(1, len(want) // 10), f"{len(want) - exact} sequences differ"


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.worker.model_runner


def test_mixed_graphs_match_eager_steps(tiny_dir):
    common = dict(dtype="float32", max_model_len=512, gpu_memory_utilization=0.3,
                  max_num_seqs=4)
    eager = LLM(str(tiny_dir), compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"},
                **common)
    assert not _runner(eager).mixed.graphs.captured
    want = _greedy(eager, PROMPTS)
    shutdown_llm(eager)

    before = CUDAGraphManager.num_captures
    llm = LLM(str(tiny_dir), compilation_config=FULL, **common)
    runner = _runner(llm)
    captured = CUDAGraphManager.num_captures - before
    assert runner.mixed.graphs.capture_sizes == list(MIXED_CAPTURE_SIZES)
    assert captured == len(runner.cuda_graphs.capture_sizes) + len(MIXED_CAPTURE_SIZES)
    # One short prompt alone: one replay of the 16-token graph, no eager forward.
    replays = runner.mixed.graphs.num_replays
    _greedy(llm, [PROMPTS[1]], max_tokens=1)
    assert runner.mixed.graphs.num_replays == replays + 1
    got = _greedy(llm, PROMPTS)
    assert runner.mixed.graphs.num_replays > replays + 5
    assert CUDAGraphManager.num_captures - before == captured  # one set per start-up
    shutdown_llm(llm)
    _assert_same_up_to_ties(got, want)


def test_mixed_graph_writes_the_grown_cache(tmp_path):
    # SmolLM2's heads (9 query, 3 KV, head size 64), fp32 random weights. 48
    # requests of ~60-190 tokens hold hundreds of blocks, all past the two the
    # graphs were captured against; 8 at a time, so prompts prefill beside decodes.
    model_dir = make_model_dir(tmp_path / "smollm2", smollm2_config(), weights=False)
    common = dict(load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=8,
                  enable_extensible_kv_cache=True, enable_prefix_caching=False)
    prompts = [[0] + [5 + (i * 11 + j) % 900 for j in range(60 + (i * 37) % 130)]
               for i in range(48)]
    eager = LLM(str(model_dir), compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"},
                **common)
    want = _greedy(eager, prompts)
    shutdown_llm(eager)

    before = CUDAGraphManager.num_captures
    llm = LLM(str(model_dir), compilation_config=FULL, **common)
    captured = CUDAGraphManager.num_captures - before
    worker = llm.llm_engine.engine_core.worker
    # Grown after the capture (to what 8 x 1024 tokens can use: ~513 blocks).
    assert worker.kv_cache.committed_blocks > 256
    got = _greedy(llm, prompts)
    assert worker.model_runner.mixed.graphs.num_replays >= 20
    assert CUDAGraphManager.num_captures - before == captured  # never re-captured
    shutdown_llm(llm)
    _assert_same_up_to_ties(got, want)
