"""No Triton compilation on the request path (issue 10, item 1).

CPU: the warm-up's list of attention variants (`reachable_configs`) holds every
config `select_config` returns over a brute-force grid of batches within the
engine's bounds, and the kernels do not specialise on the per-step integers.
CUDA: after start-up, serving prompts of many lengths at several batch sizes
compiles no Triton kernel (counted with triton's post-compile hook).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.triton_interpreter import needs_triton

pytestmark = needs_triton

SHAPES = [  # (num_kv_heads, queries_per_kv, head_size, dtype): 8B, SmolLM2, MHA fp32, GQA 8
    (8, 4, 128, torch.bfloat16), (3, 3, 64, torch.bfloat16), (4, 1, 64, torch.float32),
    (1, 8, 256, torch.float16),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bounds", [(8192, 4096, 132), (512, 512, 8), (16, 64, 132)])
def test_reachable_configs_cover_every_selected_config(shape, bounds):
    from vllm.v1.attention.ops.attention_config import (
        LARGE_MIN_SEQ_LEN,
        reachable_configs,
        select_config,
    )

    num_kv_heads, queries_per_kv, head_size, dtype = shape
    max_num_tokens, max_model_len, sm_count = bounds
    common = dict(num_kv_heads=num_kv_heads, queries_per_kv=queries_per_kv,
                  head_size=head_size, dtype=dtype, sm_count=sm_count)
    listed = reachable_configs(max_num_tokens=max_num_tokens, max_model_len=max_model_len,
                               **common)
    configs = {cfg for _, cfg in listed}
    assert len(configs) == len(listed)
    lengths = sorted({1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 100, 128, 511, 2048,
                      max_num_tokens})
    seen = set()
    for query_len, num_reqs, extra, seq_len in itertools.product(
        lengths, (1, 2, 3, 8, 32, 256), (0, 1, 7, 300),
        (1, 100, 255, 256, 1000, 1023, 1024, 4096, 8192),
    ):
        num_tokens = query_len + (num_reqs - 1) * min(query_len, 1 + extra)
        if num_tokens > max_num_tokens or not query_len <= seq_len <= max_model_len:
            continue
        cfg = select_config(num_tokens=num_tokens, num_reqs=num_reqs, max_query_len=query_len,
                            max_seq_len=seq_len, **common)
        seen.add(cfg)
        assert cfg in configs, (num_tokens, num_reqs, query_len, seq_len, cfg)
    assert seen  # the grid exercised the selector
    # Each listed config is selected for its query length (tiles) at max_model_len or just
    # below the large tile's key count, with splits at most that launch's own.
    for query_len, cfg in listed:
        autos = [select_config(num_tokens=query_len, num_reqs=1, max_query_len=query_len,
                               max_seq_len=seq, **common)
                 for seq in {max_model_len, min(max_model_len, LARGE_MIN_SEQ_LEN - 1)}]
        assert any((a.block_m, a.block_n) == (cfg.block_m, cfg.block_n)
                   and cfg.num_splits <= a.num_splits for a in autos), (query_len, cfg, autos)


def test_attention_kernels_do_not_specialise_on_per_step_integers():
    from vllm.v1.attention.ops import unified_attention as ua

    for kernel in (ua._unified_attention_kernel, ua._reduce_splits_kernel):
        flags = {p.name: p.do_not_specialize for p in kernel.params}
        assert flags["num_tokens"] and flags["num_reqs"], kernel
        assert not flags["num_heads"]  # fixed per model: its divisibility helps addressing


@pytest.mark.cuda
@pytest.mark.parametrize("fresh_prefill", ["0", "1"])  # VLLM_FRESH_PREFILL_ATTENTION
def test_serving_after_start_up_compiles_no_triton_kernel(tmp_path, monkeypatch, fresh_prefill):
    import triton

    from tests.model_dirs import make_model_dir, smollm2_config
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_FRESH_PREFILL_ATTENTION", fresh_prefill)
    model_dir = make_model_dir(tmp_path / "smollm2", smollm2_config(), weights=False)
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=64)
    compiled: list[str] = []

    def count(*args, **kwargs):
        compiled.append(kwargs.get("repr", "?"))
        return None

    kernels = _our_kernels()
    cached_before = _num_compiled(kernels)
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)  # triton >= 3.4
    previous = getattr(knobs, "jit_post_compile_hook", None)
    if knobs is not None:
        knobs.jit_post_compile_hook = count
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        rng = random.Random(0)  # fresh random tokens: no prefix-cache hits
        for batch, length in itertools.product((1, 3, 16, 33), (1, 7, 16, 33, 128, 511, 1500)):
            prompts = [{"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(length)]}
                       for _ in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)
        compiled_variants = _num_compiled(kernels) - cached_before
    finally:
        if knobs is not None:
            knobs.jit_post_compile_hook = previous
        llm.llm_engine.shutdown()
    assert compiled == []
    assert compiled_variants == 0  # the same, from the kernels' own caches


def _our_kernels() -> list:
    """Every Triton kernel the engine launches (the modules' @triton.jit functions)."""
    from triton.runtime.jit import JITFunction

    from vllm.model_executor.layers.ops import activation, gemv, rms_norm, rotary
    from vllm.v1.attention.ops import (
        prefill_attention,
        reshape_and_cache,
        rope_and_cache,
        unified_attention,
    )

    modules = (activation, gemv, rms_norm, rotary, reshape_and_cache, rope_and_cache,
               prefill_attention, unified_attention)
    return [v for m in modules for v in vars(m).values() if isinstance(v, JITFunction)]


def _num_compiled(kernels: list) -> int:
    """Compiled variants held by the kernels' per-device caches (first item of each entry)."""
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())
