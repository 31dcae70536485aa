"""End-to-end engine checks on CUDA: CUDA graphs, both KV sizing paths, real shapes.

Random-weight checkpoints keep these self-contained on a machine without a
network; the bundled-model checks live in test_offline_engine.py (CPU) and
run on CUDA too when the model is installed.
"""

from __future__ import annotations

import pytest
import torch

from tests.model_dirs import llama3_8b_config, make_model_dir, smollm2_config
from tests.v1.e2e.utils import shutdown_llm
from vllm import LLM, SamplingParams
from vllm.v1.worker.cuda_graph import CUDAGraphManager
from vllm.v1.worker.kv_cache_sizing import blocks_filling_granules, max_useful_blocks

pytestmark = pytest.mark.cuda

PROMPTS = [
    [0] + list(range(5, 5 + n)) for n in (3, 17, 40, 129, 250)
]  # token-id prompts: random weights make text meaningless anyway


def _greedy(llm: LLM, max_tokens: int = 48) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers_with_cuda_graphs(tiny_dir):
    """Token-for-token equal to transformers, up to exact near-ties.

    fp32 on both sides (no TF32), but GEMM reduction orders differ between a
    padded graph batch and transformers' batch of one, so two candidates whose
    logits agree to ~1e-5 may swap. Where the sequences first differ, the two
    tokens must be such a tie under transformers' own logits; anything else
    is a bug.
    """
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    assert llm.llm_engine.engine_core.worker.model_runner.cuda_graphs.captured
    ours = _greedy(llm, 24)
    shutdown_llm(llm)
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).cuda()
    hf.generation_config.eos_token_id = None  # like ignore_eos: never stop early
    exact = 0
    for prompt, got in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ref = out.sequences[0, len(prompt) :].tolist()
        if got == ref:
            exact += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
        logits = out.logits[i][0].float()
        gap = float(logits[ref[i]] - logits[got[i]])
        assert 0 <= gap < 1e-3, f"prompt of {len(prompt)} tokens: token {i} differs by {gap}"
    assert exact >= len(PROMPTS) - 1


@pytest.mark.parametrize("shape", ["smollm2", "llama3_8b"])
def test_classic_and_extensible_paths_byte_identical(tmp_path, shape):
    config = smollm2_config() if shape == "smollm2" else llama3_8b_config()
    model_dir = make_model_dir(tmp_path / shape, config, weights=False)
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=4096)

    classic = LLM(str(model_dir), enable_extensible_kv_cache=False, **common)
    classic_blocks = classic.llm_engine.engine_core.num_blocks
    classic_out = _greedy(classic)
    shutdown_llm(classic)

    captures_before = CUDAGraphManager.num_captures
    ext = LLM(str(model_dir), enable_extensible_kv_cache=True, **common)
    captured = CUDAGraphManager.num_captures - captures_before
    worker = ext.llm_engine.engine_core.worker
    ext_blocks = ext.llm_engine.engine_core.num_blocks
    ext_out = _greedy(ext)
    # Graphs were captured once, before the extension, and never again.
    runner = worker.model_runner
    assert captured == len(runner.cuda_graphs.capture_sizes) + len(
        runner.mixed.graphs.capture_sizes) > 0
    assert CUDAGraphManager.num_captures - captures_before == captured
    assert worker.kv_cache.committed_blocks == ext_blocks
    kv_config, granularity = worker.kv_cache.config, worker.kv_cache.driver.granularity
    shutdown_llm(ext)

    assert ext_out == classic_out
    # The extensible cache commits no more than 256 seqs x 4096 tokens can use
    # (65537 blocks, up to the end of their granules): the SmolLM2 shape's
    # classic cache (0.92 of the device) is larger than that; the 8B shape's
    # is smaller, and the measured extensible cache holds more than it.
    use_cap = blocks_filling_granules(max_useful_blocks(256, 4096, 16), kv_config.block_stride,
                                      kv_config.num_segments, granularity)
    if shape == "smollm2":
        assert ext_blocks == use_cap < classic_blocks
    else:
        assert classic_blocks < ext_blocks <= use_cap


def test_elastic_engine_grows_and_shrinks_without_recapture_and_matches(tmp_path, monkeypatch):
    # Issue #18 on the GPU: 64 requests of ~400 tokens need ~1700 blocks; the
    # elastic engine starts at its floor (one 1024-token request), grows while
    # serving, shrinks when idle, never re-captures a graph, and its greedy
    # outputs equal the non-elastic engine's.
    monkeypatch.setenv("VLLM_ELASTIC_KV_SHRINK_DELAY_S", "0")
    model_dir = make_model_dir(tmp_path / "smollm2", smollm2_config(), weights=False)
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=64)
    prompts = [{"prompt_token_ids": [0] + [5 + (i * 7 + j) % 900 for j in range(400)]}
               for i in range(64)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = LLM(str(model_dir), **common)
    expected = run(reference)
    shutdown_llm(reference)
    before = CUDAGraphManager.num_captures
    elastic = LLM(str(model_dir), enable_elastic_kv_cache=True, **common)
    captured = CUDAGraphManager.num_captures - before
    core = elastic.llm_engine.engine_core
    floor, floor_bytes = core.num_blocks, core.worker.kv_cache.committed_bytes
    assert floor == core.scheduler.elastic.floor < core.scheduler.elastic.limit
    assert run(elastic) == expected
    assert core.scheduler.elastic.num_grows >= 1
    for _ in range(20):
        elastic.llm_engine.engine_core.adjust_kv_cache()
    assert core.num_blocks == floor and core.worker.kv_cache.committed_bytes == floor_bytes
    assert core.scheduler.elastic.num_shrinks >= 1
    assert CUDAGraphManager.num_captures - before == captured > 0  # never re-captured
    # The runtime limit takes blocks' bytes, the unit kv_cache_memory (/metrics) reports:
    # a figure read there comes back as the same count.
    memory = core.kv_cache_memory()
    block_bytes = memory.block_bytes
    assert memory.in_use_bytes == 0 and memory.committed_bytes == floor * block_bytes
    limit = floor + 64
    assert elastic.llm_engine.set_kv_cache_limit(limit * block_bytes + block_bytes - 1) == limit
    assert core.kv_cache_memory().limit_bytes == limit * block_bytes
    grows = core.scheduler.elastic.num_grows
    capped = run(elastic)  # preempts more: bf16 greedy ids may differ from `expected`
    assert [len(ids) for ids in capped] == [16] * 64
    assert core.scheduler.elastic.num_grows > grows and core.num_blocks <= limit
    elastic.llm_engine.set_kv_cache_limit(None)
    assert run(elastic) == expected
    shutdown_llm(elastic)


def test_classic_cache_of_an_explicit_size_is_checked_against_free_memory(tmp_path):
    """--no-enable-extensible-kv-cache with --kv-cache-memory-bytes: a size that fits is
    allocated as asked; one above the device's free memory is a sizing error naming the
    flag, before torch tries to allocate it (94fbdd1)."""
    from vllm.v1.worker.kv_cache_sizing import KVCacheSizingError
    model_dir = make_model_dir(tmp_path / "smollm2", smollm2_config(), weights=False)
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024,
                  enable_extensible_kv_cache=False)
    llm = LLM(str(model_dir), kv_cache_memory_bytes=256 << 20, **common)
    try:
        assert all(len(t) == 48 for t in _greedy(llm))
    finally:
        shutdown_llm(llm)
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises((KVCacheSizingError, RuntimeError), match="kv_cache_memory_bytes"):
        LLM(str(model_dir), kv_cache_memory_bytes=free + (64 << 30), **common)
