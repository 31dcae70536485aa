"""The fused rope + KV-cache-write kernel against its torch reference (issue 10, item 3).

Reference: `RotaryEmbedding.forward_native` then `reshape_and_cache_ref`. The
rotation shares `_rope_heads` with the rotary kernel, so fp32/fp16 outputs are
bit-identical on the interpreter and on CUDA; the interpreter's truncating bf16
casts get the tolerance of `test_fused_ops.assert_matches`.

CPU: the cases run in one TRITON_INTERPRET=1 subprocess (tests/triton_interpreter.py).
CUDA (`-m cuda`): the same checks on the GPU, the Triton attention backend's
`forward_with_rope` against rope + `forward`, and a launch count: one kernel
fewer per layer than rotary + reshape_and_cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.model_executor.test_fused_ops import (
    _LLAMA3_SCALING,
    _generator,
    _randn,
    assert_matches,
)
from tests.triton_interpreter import (
    check_result,
    needs_triton,
    run_checks,
    run_interpreted,
)
from vllm.model_executor.layers.rotary_embedding import get_rope


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary_dim: int
    num_tokens: int
    block_size: int = 16
    neox: bool = True
    llama3: bool = False
    padded: tuple[int, ...] = ()  # tokens whose slot is -1 (padding)


def _inputs(case: Case, device: str):
    gen = _generator(case.name, device)
    dtype = getattr(torch, case.dtype)
    t, d = case.num_tokens, case.head_size
    q_size, kv_size = case.num_heads * d, case.num_kv_heads * d
    qkv = _randn((t, q_size + 2 * kv_size), dtype, gen, device)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, 300, (t,), generator=gen, device=device)
    num_blocks = t // case.block_size + 3
    cache = _randn((num_blocks, 2, case.block_size, case.num_kv_heads, d), dtype, gen, device)
    # Distinct slots outside block 0, in a scrambled order.
    slots = torch.randperm((num_blocks - 1) * case.block_size, generator=gen, device=device)
    slots = (slots[:t] + case.block_size).to(torch.int64)
    for i in case.padded:
        slots[i] = -1
    scaling = dict(_LLAMA3_SCALING) if case.llama3 else None
    rope = get_rope(d, case.rotary_dim, 300, 10000.0, scaling, case.neox).to(device)
    return positions, query, key, value, rope, cache, slots


def check_rope_and_cache(case: Case, device: str) -> None:
    from vllm.v1.attention.ops.rope_and_cache import rope_and_cache, rope_and_cache_ref

    positions, query, key, value, rope, cache, slots = _inputs(case, device)
    qkv_before = (query.clone(), key.clone(), value.clone())
    cache_ref, cache_before = cache.clone(), cache.clone()
    q = rope_and_cache(positions, query, key, value, rope.cos_sin_cache, cache, slots, case.neox)
    q_ref = rope_and_cache_ref(positions, query, key, value, rope, cache_ref, slots)
    assert_matches(q, q_ref, device, exact=True)
    assert_matches(cache, cache_ref, device, exact=True)  # untouched slots too
    for before, now in zip(qkv_before, (query, key, value), strict=True):
        assert torch.equal(before, now), "inputs were modified"
    assert not torch.equal(q, query)  # the rotation did something
    # The cache really received the rotated key (not the raw one) at a real slot.
    t = next(i for i in range(case.num_tokens) if i not in case.padded)
    block, off = divmod(int(slots[t]), case.block_size)
    _, k_rot = rope.forward_native(positions, query, key)
    written = cache[block, 0, off].reshape(-1)
    assert_matches(written, k_rot[t].contiguous(), device, exact=True)
    # key_out (the fresh-prefill path): every row's rotated key, the same cache writes.
    cache_again, key_out = cache_before, torch.full_like(key, float("nan")).contiguous()
    q_again = rope_and_cache(positions, query, key, value, rope.cos_sin_cache, cache_again,
                             slots, case.neox, key_out=key_out)
    assert torch.equal(q_again, q) and torch.equal(cache_again, cache)
    assert_matches(key_out, k_rot.contiguous(), device, exact=True)


# Small on purpose: the interpreter runs every program in Python.
INTERPRETED = [
    Case("rc_fp32_gqa2_d32_bs16", "float32", 4, 2, 32, 32, 9, padded=(3, 8)),
    Case("rc_fp16_gptj_partial_d24_bs4", "float16", 3, 1, 24, 16, 6, block_size=4, neox=False),
    Case("rc_fp16_llama3_d16_bs8", "float16", 6, 3, 16, 16, 5, block_size=8, llama3=True),
    Case("rc_bf16_neox_partial_d32", "bfloat16", 4, 2, 32, 8, 4, padded=(0,)),
    Case("rc_fp32_mha_d64_bs1", "float32", 3, 3, 64, 64, 3, block_size=1),
]
CUDA = [
    *INTERPRETED,
    Case("rc_bf16_smollm2_9x3_d64", "bfloat16", 9, 3, 64, 64, 33, padded=(32,)),
    Case("rc_bf16_llama8b_32x8_d128", "bfloat16", 32, 8, 128, 128, 130, llama3=True),
    Case("rc_fp16_qwen_14x2_d64_bs32", "float16", 14, 2, 64, 64, 70, block_size=32),
]


def _run_interpreted_cases() -> dict[str, str]:
    return run_checks(((check_rope_and_cache, INTERPRETED),))


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.v1.attention.test_rope_and_cache", timeout_s=300)


@needs_triton
@pytest.mark.parametrize("name", [c.name for c in INTERPRETED])
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


@needs_triton
def test_launcher_rejects_bad_inputs() -> None:
    """Precise ValueErrors, checked before any launch (CPU tensors are rejected last)."""
    from vllm.v1.attention.ops.rope_and_cache import rope_and_cache

    case = Case("bad", "float32", 4, 2, 32, 32, 3)
    positions, query, key, value, rope, cache, slots = _inputs(case, "cpu")
    cs = rope.cos_sin_cache
    bad = [
        ((positions, query, key, value, cs, cache[:, 0], slots), "kv_cache must be"),
        ((positions.float(), query, key, value, cs, cache, slots), "positions must be"),
        ((positions, query, key[:, :32], value, cs, cache, slots), "key must be [3, 2 * 32]"),
        ((positions, query, key, value.half(), cs, cache, slots), "value must have the cache's"),
        ((positions, query, key, value, cs, cache, slots.int()), "slot_mapping must be"),
        ((positions, query, key, value, cs, cache.transpose(3, 4), slots), "contiguous"),
        ((positions, query, key, value, torch.cat([cs, cs], 1), cache, slots), "rotary_dim even"),
        ((positions, query, key, value, cs, cache, slots), "needs CUDA tensors"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("*", r"\*")):
            rope_and_cache(*args)
    with pytest.raises(ValueError, match=r"key_out must be contiguous torch.float32 \(3, 64\)"):
        rope_and_cache(positions, query, key, value, cs, cache, slots, key_out=key[:, :32])


def test_default_forward_with_rope_is_rope_then_forward() -> None:
    """The torch backend (no fused kernel) rotates with the module, then writes and attends."""
    from vllm.v1.attention.backends.abstract import AttentionMetadata
    from vllm.v1.attention.backends.torch_attn import TorchAttentionImpl

    case = Case("torch_default", "float32", 4, 2, 32, 32, 5)
    positions, query, key, value, rope, cache, _ = _inputs(case, "cpu")
    cache.zero_()
    impl = TorchAttentionImpl(4, 32, 32**-0.5, 2)
    starts = torch.tensor([0, 5], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=5, max_query_len=5, query_start_loc=starts, max_seq_len=5,
        seq_lens=lens, block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.arange(16, 21), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )
    out = torch.empty(5, 4, 32)
    impl.forward_with_rope(positions, rope, query, key, value, cache, meta, out)
    q, k = rope(positions, query, key)
    cache_ref, out_ref = torch.zeros_like(cache), torch.empty(5, 4, 32)
    impl.forward(q.view(5, 4, 32), k.view(5, 2, 32), value.reshape(5, 2, 32), cache_ref, meta,
                 out_ref)
    assert torch.equal(cache, cache_ref) and torch.equal(out, out_ref)
    assert torch.equal(cache[1, 0, :5].reshape(5, -1), k)  # rotated keys were written


# --- CUDA -------------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", CUDA, ids=lambda c: c.name)
def test_rope_and_cache_cuda(case: Case) -> None:
    check_rope_and_cache(case, "cuda")


def _backend_inputs():
    from vllm.v1.attention.backends.abstract import AttentionMetadata

    case = Case("backend", "bfloat16", 8, 2, 64, 64, 7, padded=(6,))
    positions, query, key, value, rope, cache, slots = _inputs(case, "cuda")
    slots = torch.tensor([16, 17, 18, 19, 32, 33, -1], device="cuda")  # 2 requests: 4 + 2
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)
    lens = torch.tensor([4, 2], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=6, max_query_len=4, query_start_loc=starts.cuda(), max_seq_len=4,
        seq_lens=lens.cuda(), block_table=torch.tensor([[1], [2]], dtype=torch.int32).cuda(),
        slot_mapping=slots, query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )
    return positions, query, key, value, rope, cache, meta


@pytest.mark.cuda
@needs_triton
def test_triton_backend_forward_with_rope_cuda() -> None:
    """Fused path == rope then forward (same cache bytes, same output), one launch fewer."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    positions, query, key, value, rope, cache, meta = _backend_inputs()
    impl = TritonAttentionImpl(8, 64, 64**-0.5, 2)
    cache_ref = cache.clone()
    out, out_ref = (torch.empty(7, 8, 64, dtype=torch.bfloat16, device="cuda") for _ in "ab")

    def fused():
        impl.forward_with_rope(positions, rope, query, key, value, cache, meta, out)

    def unfused():
        q, k = rope(positions, query, key)
        impl.forward(q.view(7, 8, 64), k.view(7, 2, 64), value.reshape(7, 2, 64), cache_ref,
                     meta, out_ref)

    fused(), unfused()
    torch.cuda.synchronize()
    assert torch.equal(cache, cache_ref)
    assert torch.equal(out, out_ref)

    def kernels(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    if not kernels(lambda: query + 1):
        pytest.skip("the profiler records no CUDA kernels on this machine (CUPTI)")
    got, ref = kernels(fused), kernels(unfused)
    assert any("_rope_and_cache_kernel" in k for k in got), got
    assert len(got) == len(ref) - 1, (got, ref)
