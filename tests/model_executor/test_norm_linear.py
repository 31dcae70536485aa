"""Norm/activation fused into the projection after it (issue 10, item 3), against torch.

Reference: the layers' own torch code (`RMSNorm.forward_native`,
`SiluAndMul.forward_native`) followed by `F.linear` in float64 on the rounded
activations, so the only differences allowed are the float32 sum order of the
kernel's dot (checked as a tolerance scaled by |a| @ |W|, ~ a few float32 ulps
before the output rounding, then one output ulp) and the new residual stream,
which must be bit-identical.

CPU: cases run in one TRITON_INTERPRET=1 subprocess (fp32/fp16: the
interpreter's bf16 dot is unreliable). CUDA (`-m cuda`): bf16/fp16/fp32 cases,
the dispatch in `layers/fused_linear.py` (launch counts per decoder layer), and a
captured graph replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.model_executor.test_fused_ops import _generator, _randn
from tests.triton_interpreter import check_result, needs_triton, run_checks, run_interpreted
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    rows: int
    k: int  # input features (hidden, or intermediate for silu)
    n: int  # output features
    residual: bool = True
    bias: bool = False
    strided: bool = False  # x rows of a wider buffer


def _close(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor, bias, device: str) -> None:
    """got == a @ w^T (+ bias) up to float32 sum order plus one output rounding."""
    ref = a.double() @ w.double().T
    if bias is not None:
        ref = ref + bias.double()
    bound = a.double().abs() @ w.double().abs().T
    eps_out = torch.finfo(got.dtype).eps
    tol = bound * 64 * torch.finfo(torch.float32).eps + ref.abs() * eps_out + 1e-30
    if got.dtype == torch.bfloat16 and device == "cpu":
        tol = tol + ref.abs() * 2 * eps_out
    err = (got.double() - ref).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3e}"


def check_norm_linear(case: Case, device: str) -> None:
    from vllm.model_executor.layers.ops.norm_linear import rms_norm_linear

    gen = _generator(case.name, device)
    dtype = getattr(torch, case.dtype)
    width = case.k + (8 if case.strided else 0)
    x = _randn((case.rows, width), dtype, gen, device, 2.0)[:, : case.k]
    residual = _randn((case.rows, case.k), dtype, gen, device) if case.residual else None
    norm = RMSNorm(case.k, 1e-5).to(device=device, dtype=dtype)
    norm.weight.data.copy_(_randn((case.k,), dtype, gen, device))
    w = _randn((case.n, case.k), dtype, gen, device, case.k**-0.5)
    b = _randn((case.n,), dtype, gen, device) if case.bias else None
    before = (x.clone(), None if residual is None else residual.clone())
    y, new_res = rms_norm_linear(x, residual, norm.weight, 1e-5, w, b)
    if residual is None:
        a, res_ref = norm.forward_native(x), None
        assert new_res is None
    else:
        a, res_ref = norm.forward_native(x, residual)
        assert torch.equal(new_res, res_ref), "the residual stream must be exact"
        assert torch.equal(residual, before[1])
    assert torch.equal(x, before[0]), "inputs were modified"
    assert y.shape == (case.rows, case.n) and y.dtype == dtype
    _close(y, a, w, b, device)


def check_silu_linear(case: Case, device: str) -> None:
    from vllm.model_executor.layers.ops.norm_linear import silu_and_mul_linear

    gen = _generator(case.name, device)
    dtype = getattr(torch, case.dtype)
    width = 2 * case.k + (8 if case.strided else 0)
    x = _randn((case.rows, width), dtype, gen, device, 3.0)[:, : 2 * case.k]
    w = _randn((case.n, case.k), dtype, gen, device, case.k**-0.5)
    before = x.clone()
    y = silu_and_mul_linear(x, w)
    assert torch.equal(x, before)
    _close(y, SiluAndMul().forward_native(x), w, None, device)


INTERPRETED_NORM = [
    Case("nl_fp32_r1_k576_n40", "float32", 1, 576, 40),
    Case("nl_fp16_r5_k100_n33_bias_strided", "float16", 5, 100, 33, bias=True, strided=True),
    Case("nl_fp32_r16_k64_n16_nores", "float32", 16, 64, 16, residual=False),
]
INTERPRETED_SILU = [
    Case("sl_fp32_r3_k200_n24", "float32", 3, 200, 24),
    Case("sl_fp16_r16_k130_n17_strided", "float16", 16, 130, 17, strided=True),
]
CUDA_NORM = [
    *INTERPRETED_NORM,
    Case("nl_bf16_smollm2_qkv_r1", "bfloat16", 1, 576, 960),
    Case("nl_bf16_smollm2_gate_up_r16", "bfloat16", 16, 576, 3072),
    Case("nl_bf16_qwen_qkv_bias_r7", "bfloat16", 7, 896, 1152, bias=True),
    Case("nl_fp16_nores_r2_k2048", "float16", 2, 2048, 100, residual=False),
]
CUDA_SILU = [
    *INTERPRETED_SILU,
    Case("sl_bf16_smollm2_down_r1", "bfloat16", 1, 1536, 576),
    Case("sl_bf16_smollm2_down_r16", "bfloat16", 16, 1536, 576),
]


def _run_interpreted_cases() -> dict[str, str]:
    return run_checks(
        ((check_norm_linear, INTERPRETED_NORM), (check_silu_linear, INTERPRETED_SILU))
    )


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.model_executor.test_norm_linear", timeout_s=300)


@needs_triton
@pytest.mark.parametrize("name", [c.name for c in INTERPRETED_NORM + INTERPRETED_SILU])
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


@needs_triton
def test_launchers_reject_bad_inputs() -> None:
    from vllm.model_executor.layers.ops.norm_linear import rms_norm_linear, silu_and_mul_linear

    x, w, nw = torch.zeros(3, 64), torch.zeros(8, 64), torch.ones(64)
    cases = [
        (lambda: rms_norm_linear(torch.zeros(17, 64), None, nw, 1e-5, w), r"M <= 16"),
        (lambda: rms_norm_linear(x, None, nw, 1e-5, torch.zeros(8, 32)), r"weight must be \[N, 64"),
        (lambda: rms_norm_linear(x, None, nw.half(), 1e-5, w), "norm_weight must be"),
        (lambda: rms_norm_linear(x, torch.zeros(2, 64), nw, 1e-5, w), "residual must match"),
        (lambda: rms_norm_linear(x, None, nw, 1e-5, w, torch.zeros(7)), "bias must be"),
        (lambda: rms_norm_linear(x, None, nw, 1e-5, w), "needs CUDA tensors"),
        (lambda: silu_and_mul_linear(torch.zeros(2, 63), w), "must be even"),
        (lambda: silu_and_mul_linear(torch.zeros(2, 64), w), r"weight must be \[N, 32\]"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_cpu_takes_the_unfused_path() -> None:
    """On CPU the helpers are exactly the modules one after the other."""
    from vllm.model_executor.layers.fused_linear import act_and_project, norm_and_project
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    norm, lin = RMSNorm(32), ColumnParallelLinear(32, 48, bias=False)
    lin.weight.data.normal_()
    x, res = torch.randn(3, 32), torch.randn(3, 32)
    y, new_res = norm_and_project(norm, lin, x, res)
    h, r = norm(x, res)
    assert torch.equal(y, lin(h)) and torch.equal(new_res, r)
    y, none = norm_and_project(norm, lin, x)
    assert none is None and torch.equal(y, lin(norm(x)))
    down = RowParallelLinear(24, 32, bias=False)
    down.weight.data.normal_()
    assert torch.equal(act_and_project(SiluAndMul(), down, y), down(SiluAndMul()(y)))


# --- CUDA -------------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", CUDA_NORM, ids=lambda c: c.name)
def test_norm_linear_cuda(case: Case) -> None:
    check_norm_linear(case, "cuda")


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", CUDA_SILU, ids=lambda c: c.name)
def test_silu_linear_cuda(case: Case) -> None:
    check_silu_linear(case, "cuda")


@pytest.mark.cuda
@needs_triton
def test_dispatch_fuses_only_small_batches_and_weights_cuda(monkeypatch) -> None:
    """Switched on: small batch + small weight: one launch; 17 rows or a big weight: norm +
    cuBLAS. Off (the default): never fused."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm.model_executor.layers import fused_linear
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.layers.ops.norm_linear import MAX_ROWS

    def kernels(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    with torch.device("cuda"):
        norm = RMSNorm(576).to(torch.bfloat16)
        small = ColumnParallelLinear(576, 960, bias=False).to(torch.bfloat16)
        big = ColumnParallelLinear(576, 16384, bias=False).to(torch.bfloat16)  # 18 MiB
        small.weight.data.normal_()
        big.weight.data.normal_()
        x1, r1 = torch.randn(1, 576, dtype=torch.bfloat16), torch.randn(1, 576).bfloat16()
        x17, r17 = torch.randn(17, 576).bfloat16(), torch.randn(17, 576).bfloat16()
    off = kernels(lambda: fused_linear.norm_and_project(norm, small, x1, r1))
    assert not any("norm_linear" in k for k in off), off
    monkeypatch.setattr(fused_linear, "FUSED_LINEAR_MAX_TOKENS", MAX_ROWS)
    for args in ((small, x1, r1), (small, x17, r17), (big, x1, r1)):
        fused_linear.norm_and_project(norm, *args)  # compile
    torch.cuda.synchronize()
    if not kernels(lambda: x1 + 1):
        pytest.skip("the profiler records no CUDA kernels on this machine (CUPTI)")
    one = kernels(lambda: fused_linear.norm_and_project(norm, small, x1, r1))
    assert len(one) == 1 and "_rms_norm_linear_kernel" in one[0], one
    for args in ((small, x17, r17), (big, x1, r1)):
        got = kernels(lambda args=args: fused_linear.norm_and_project(norm, *args))
        assert not any("norm_linear" in k for k in got) and len(got) >= 2, got


@pytest.mark.cuda
@needs_triton
def test_fused_layer_replays_under_cuda_graph(monkeypatch) -> None:
    """Switched on, captured at 4 rows, replayed on new inputs: equals the unfused modules."""
    from vllm.model_executor.layers import fused_linear
    from vllm.model_executor.layers.fused_linear import act_and_project, norm_and_project
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.ops.norm_linear import MAX_ROWS

    monkeypatch.setattr(fused_linear, "FUSED_LINEAR_MAX_TOKENS", MAX_ROWS)

    torch.manual_seed(0)
    with torch.device("cuda"):
        norm = RMSNorm(576).bfloat16()
        gate_up = ColumnParallelLinear(576, 3072, bias=False).bfloat16()
        down = RowParallelLinear(1536, 576, bias=False).bfloat16()
        for p in (norm.weight, gate_up.weight, down.weight):
            p.data.normal_(0, 0.05)
        x, res = torch.randn(4, 576).bfloat16(), torch.randn(4, 576).bfloat16()

    def run():
        h, r = norm_and_project(norm, gate_up, x, res)
        return act_and_project(SiluAndMul(), down, h), r

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = run()
    for seed in range(2):
        torch.manual_seed(seed + 1)
        x.copy_(torch.randn(4, 576).bfloat16())
        res.copy_(torch.randn(4, 576).bfloat16())
        graph.replay()
        h, r = norm(x, res)
        ref = down(SiluAndMul()(gate_up(h)))
        assert torch.equal(new_res, r)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
