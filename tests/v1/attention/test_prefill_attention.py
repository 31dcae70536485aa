"""The fresh-prefill attention kernel (prompts without cached context, issue 10 item 4).

`prefill_attention` reads this step's own key/value rows through TMA
descriptors. Its reference is the paged path's: the rows written into a
NaN-filled cache by `reshape_and_cache_ref`, then `unified_attention_ref`.
Outputs start as NaN, so a row the kernel forgets stays NaN; rows past the
requests' tokens are the caller's (the backend zeroes them) and must stay NaN.

CPU: the cases run in one TRITON_INTERPRET=1 subprocess (tests/triton_interpreter.py;
its bf16 dot is wrong, so fp16). CUDA (`-m cuda`, sm_90+): the engine's shapes in
bf16/fp16 with the shipped config, and the Triton backend choosing this kernel
for a fresh prefill against the paged reference. The engine takes it unless
VLLM_FRESH_PREFILL_ATTENTION=0 (on by default).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.triton_interpreter import check_result, needs_triton, run_checks, run_interpreted
from tests.v1.attention.test_triton_kernels import TOLERANCE, Case, _batch, metadata
from vllm import envs

pytestmark = needs_triton


def _config(case: Case):
    from vllm.v1.attention.ops.attention_config import FreshPrefillConfig

    if not case.block_m:
        return None
    group = case.num_splits or 1  # the cases reuse num_splits as max_group
    return FreshPrefillConfig(case.block_m, case.block_n, max_group=group, num_warps=4,
                              num_stages=2)


def _expected(b: dict, scale: float) -> torch.Tensor:
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache_ref
    from vllm.v1.attention.ops.unified_attention import unified_attention_ref

    cache = b["kv_cache"].clone()
    reshape_and_cache_ref(b["key"], b["value"], cache, b["slot_mapping"])
    return unified_attention_ref(
        b["query"], cache, b["query_start_loc"], b["seq_lens"], b["block_table"], scale
    )


def _assert_close(output, expected, num_real, dtype):
    assert torch.isfinite(output[:num_real]).all(), "a request row was not written"
    assert torch.isnan(output[num_real:]).all(), "a padding row was written"
    tol = TOLERANCE[dtype]
    err = (output[:num_real].float() - expected[:num_real].float()).abs().max().item()
    assert torch.allclose(output[:num_real].float(), expected[:num_real].float(), atol=tol,
                          rtol=tol), f"max error {err}"


def check_prefill(case: Case, device: str) -> None:
    """prefill_attention on the step's rows vs the paged reference; raises AssertionError."""
    from vllm.v1.attention.ops.prefill_attention import prefill_attention

    assert all(ctx == 0 for _, ctx in case.reqs)
    b = _batch(case, device)
    scale = case.head_size**-0.5
    # key and value as the model passes them: strided slices of one qkv row
    qkv = torch.cat([b["key"].flatten(1), b["value"].flatten(1), b["key"].flatten(1)], dim=1)
    width = b["key"][0].numel()
    key = qkv[:, :width].view_as(b["key"])
    value = qkv[:, width : 2 * width].view_as(b["value"])
    output = torch.full_like(b["query"], float("nan"))
    returned = prefill_attention(b["query"], key, value, output, b["query_start_loc"], scale,
                                 _config(case))
    assert returned is output
    _assert_close(output, _expected(b, scale), int(b["query_start_loc"][-1]), case.dtype)


def check_backend_fresh(case: Case, device: str) -> None:
    """TritonAttentionImpl.forward on a fresh prefill takes prefill_attention, and matches."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.attention.ops import prefill_attention as pa

    b = _batch(case, device)
    scale = case.head_size**-0.5
    impl = TritonAttentionImpl(case.num_heads, case.head_size, scale, case.num_kv_heads)
    md = metadata(b)
    md.no_cached_context = True
    calls = []
    original = pa.prefill_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    import vllm.v1.attention.backends.triton_attn as backend

    backend.prefill_attention = counted
    try:
        output = torch.full_like(b["query"], float("nan"))
        impl.forward(b["query"], b["key"], b["value"], b["kv_cache"], md, output)
    finally:
        backend.prefill_attention = original
    assert calls == [1], "the backend did not take the fresh-prefill kernel"
    num_real = int(b["query_start_loc"][-1])
    assert torch.equal(output[num_real:], torch.zeros_like(output[num_real:])), "padding not 0"
    expected = _expected(b, scale)
    tol = TOLERANCE[case.dtype]
    assert torch.allclose(output.float(), expected.float(), atol=tol, rtol=tol)


# Small on purpose (the interpreter runs every program in Python). block_m/block_n
# small tiles; num_splits doubles as max_group (query heads per program).
INTERPRETED = [
    Case("fresh_fp16_gqa4_d64_g1", "float16", 16, 8, 2, 64, ((40, 0), (24, 0), (1, 0), (17, 0)),
         pad_tokens=3, block_m=16, block_n=16),
    Case("fresh_fp16_gqa4_d64_g4", "float16", 16, 8, 2, 64, ((40, 0), (1, 0), (33, 0)),
         block_m=64, block_n=32, num_splits=4),
    Case("fresh_fp16_gqa3_d64_n32", "float16", 16, 9, 3, 64, ((50, 0), (2, 0)),
         block_m=32, block_n=32, num_splits=4),  # group 3 -> one query head a program
    Case("fresh_fp16_mha_d128", "float16", 16, 2, 2, 128, ((20, 0), (19, 0)), pad_tokens=1,
         block_m=16, block_n=16),
]
INTERPRETED_BACKEND = [
    Case("fresh_backend_fp16_gqa2_d64", "float16", 16, 4, 2, 64, ((3, 0), (6, 0)),
         pad_tokens=2, bound_query_len=128),
]


def _run_interpreted_cases() -> dict[str, str]:
    from vllm.v1.attention.ops import attention_config

    # the backend's default tiles are large; the interpreter takes small ones
    small = attention_config.FreshPrefillConfig(16, 16, num_warps=4, num_stages=2)
    import vllm.v1.attention.ops.prefill_attention as pa

    pa.FRESH_PREFILL_CONFIG = small
    os.environ["VLLM_FRESH_PREFILL_ATTENTION"] = "1"  # this subprocess only
    envs.reset()
    return run_checks(((check_prefill, INTERPRETED), (check_backend_fresh, INTERPRETED_BACKEND)),
                      probe=True)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.v1.attention.test_prefill_attention", timeout_s=600)


@pytest.mark.parametrize("name", [c.name for c in INTERPRETED + INTERPRETED_BACKEND])
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


def _tensors(num_tokens=32, heads=(4, 2), head_size=64, dtype=torch.float16, device="cpu"):
    h, kv = heads
    return dict(
        query=torch.zeros(num_tokens, h, head_size, dtype=dtype, device=device),
        key=torch.zeros(num_tokens, kv, head_size, dtype=dtype, device=device),
        value=torch.zeros(num_tokens, kv, head_size, dtype=dtype, device=device),
        output=torch.zeros(num_tokens, h, head_size, dtype=dtype, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(query=torch.zeros(32, 4, 64, 1)), r"must be \[num_tokens, heads, head_size\]"),
        (dict(key=torch.zeros(32, 2, 32, dtype=torch.float16)), r"key and value must be \[32"),
        (dict(key=torch.zeros(32, 3, 64, dtype=torch.float16),
              value=torch.zeros(32, 3, 64, dtype=torch.float16)), r"multiple of key heads \(3\)"),
        (dict(output=torch.zeros(31, 4, 64, dtype=torch.float16)), "output shape"),
        (dict(output=torch.zeros(32, 4, 64)), "must share float16 or bfloat16"),
        (dict(query=torch.zeros(32, 4, 96, dtype=torch.float16),
              key=torch.zeros(32, 2, 96, dtype=torch.float16),
              value=torch.zeros(32, 2, 96, dtype=torch.float16),
              output=torch.zeros(32, 4, 96, dtype=torch.float16)), "head_size must be one of"),
        (dict(key=torch.zeros(32, 64, 2, dtype=torch.float16).transpose(1, 2)),
         "key needs contiguous"),
        (dict(query_start_loc=torch.tensor([0, 32])), "query_start_loc must be contiguous int32"),
        ({}, "needs an sm_90"),
    ],
)
def test_launcher_rejects_bad_inputs(overrides, message):
    from vllm.v1.attention.ops.prefill_attention import prefill_attention

    with pytest.raises(ValueError, match=message):
        prefill_attention(**{**_tensors(), **overrides}, scale=1.0)


def test_applies_only_when_enabled_where_the_kernel_runs_and_pays(monkeypatch):
    from vllm.v1.attention.ops.attention_config import FRESH_PREFILL_MIN_QUERY_LEN
    from vllm.v1.attention.ops.prefill_attention import fresh_prefill_applies

    n = FRESH_PREFILL_MIN_QUERY_LEN
    value = torch.zeros(8, 2, 64, dtype=torch.float16)
    monkeypatch.setenv("VLLM_FRESH_PREFILL_ATTENTION", "1")
    # The CPU (not interpreted) has no TMA; on CUDA the capability decides.
    assert not fresh_prefill_applies(n, None, None, value)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        cuda = value.cuda()
        assert fresh_prefill_applies(n, None, None, cuda)
        assert not fresh_prefill_applies(n - 1, None, None, cuda)
        assert not fresh_prefill_applies(n, None, None, cuda.float())
        odd = torch.zeros(8, 2 * 64 + 1, dtype=torch.float16, device="cuda")[:, 1:]
        assert not fresh_prefill_applies(n, None, None, odd.view(8, 2, 64))
        monkeypatch.setenv("VLLM_FRESH_PREFILL_ATTENTION", "0")  # the way to turn it off
        envs.reset()  # parsed once per process: read again
        assert not fresh_prefill_applies(n, None, None, cuda)
        monkeypatch.delenv("VLLM_FRESH_PREFILL_ATTENTION")  # on by default
        envs.reset()
        assert fresh_prefill_applies(n, None, None, cuda)


@pytest.mark.parametrize("flag", ["yes", "2", ""])
def test_a_bad_switch_value_is_an_error_not_a_guess(monkeypatch, flag):
    from vllm.v1.attention.ops.prefill_attention import fresh_prefill_applies

    monkeypatch.setenv("VLLM_FRESH_PREFILL_ATTENTION", flag)
    with pytest.raises(ValueError, match="VLLM_FRESH_PREFILL_ATTENTION must be"):
        fresh_prefill_applies(128, None, None, torch.zeros(8, 2, 64, dtype=torch.float16))


def test_prefill_kernel_does_not_specialise_on_per_step_integers():
    from vllm.v1.attention.ops import prefill_attention as pa

    flags = {p.name: p.do_not_specialize for p in pa._prefill_attention_kernel.params}
    assert flags["num_tokens"] and flags["num_reqs"]


# --- CUDA (sm_90+) ------------------------------------------------------------------------
def _needs_sm90():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("needs an sm_90+ CUDA GPU (TMA)")


_LENS = ((1000, 0), (513, 0), (1, 0), (128, 0), (2048, 0), (129, 0))
CUDA = [
    Case(f"fresh_{dtype}_{tag}", dtype, 16, h, kv, d, _LENS, pad_tokens=7)
    for dtype in ("bfloat16", "float16")
    for tag, h, kv, d in (("8b", 32, 8, 128), ("smollm2", 9, 3, 64), ("mha", 8, 8, 64),
                          ("gqa8", 16, 2, 128))
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA, ids=lambda c: c.name)
def test_prefill_attention_cuda(case: Case) -> None:
    _needs_sm90()
    check_prefill(case, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA[:2], ids=lambda c: c.name)
def test_backend_takes_fresh_prefill_cuda(case: Case, monkeypatch) -> None:
    _needs_sm90()
    monkeypatch.setenv("VLLM_FRESH_PREFILL_ATTENTION", "1")
    check_backend_fresh(case, "cuda")
