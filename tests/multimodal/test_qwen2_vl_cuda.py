"""Qwen2-VL on CUDA: greedy tokens equal transformers' (fp32, CPU reference) with decode
CUDA graphs replaying M-RoPE's shifted positions, for 0, 1 and 2 images, and through a
chunked prefill; the start-up plan names the encoder budget.

Run on the GPU box:  pytest -q -m cuda tests/multimodal/test_qwen2_vl_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from tests.multimodal.test_qwen2_vl_offline import GREEDY, IMAGES, MAX_TOKENS, PROMPTS, _mm

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("max_num_batched_tokens", [256, 8])
def test_cuda_greedy_matches_transformers(qwen2_vl_dir, qwen2_vl_reference, no_tf32,
                                          max_num_batched_tokens):
    from vllm import LLM

    llm = LLM(str(qwen2_vl_dir), dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_bytes=64 * 2**20)
    try:
        prompts = [{"prompt": t, "multi_modal_data": _mm(n)} if n else t
                   for t, n in PROMPTS.values()]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for out, (text, names) in zip(outs, PROMPTS.values(), strict=True):
            ids = llm.get_tokenizer().encode(text)
            want = qwen2_vl_reference(ids, [IMAGES[n] for n in names], MAX_TOKENS)
            assert list(out.outputs[0].token_ids) == want, text
        assert llm.llm_engine.engine_core.plan.encoder_budget >= 16
    finally:
        llm.llm_engine.shutdown()


def test_image_requests_compile_no_triton_kernel(qwen2_vl_dir):
    """After start-up, image requests of every size and chunking compile nothing (the vision
    tower is torch; the language model's kernels were warmed up on its own path)."""
    import triton

    from tests.multimodal.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, image
    from tests.v1.attention.test_attention_warmup import _num_compiled, _our_kernels
    from vllm import LLM, SamplingParams

    llm = LLM(str(qwen2_vl_dir), load_format="dummy", dtype="bfloat16", max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory_bytes=64 * 2**20)
    compiled: list[str] = []
    kernels = _our_kernels()
    before = _num_compiled(kernels)
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    previous = getattr(knobs, "jit_post_compile_hook", None)
    if knobs is not None:
        knobs.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr", "?"))
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for batch, (w, h) in [(1, (50, 50)), (3, (90, 50)), (8, (120, 110)), (2, (56, 200))]:
            prompts = [{"prompt": f"text {i} {IMAGE_PLACEHOLDER} more text " * 2,
                        "multi_modal_data": {"image": [image(w, h, i), image(h, w, i + 50)]}}
                       for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)
        grown = _num_compiled(kernels) - before
    finally:
        if knobs is not None:
            knobs.jit_post_compile_hook = previous
        llm.llm_engine.shutdown()
    assert compiled == [] and grown == 0
