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
    kernel: str = "dot"  # "dot": ops/norm_linear.py; "gemv": the one-row ops/gemv.py prologues


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
    from vllm.model_executor.layers.ops.gemv import gemv_rms_norm
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
    launch = gemv_rms_norm if case.kernel == "gemv" else rms_norm_linear
    y, new_res = launch(x, residual, norm.weight, 1e-5, w, b)
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
    from vllm.model_executor.layers.ops.gemv import gemv_silu_and_mul
    from vllm.model_executor.layers.ops.norm_linear import silu_and_mul_linear

    gen = _generator(case.name, device)
    dtype = getattr(torch, case.dtype)
    width = 2 * case.k + (8 if case.strided else 0)
    x = _randn((case.rows, width), dtype, gen, device, 3.0)[:, : 2 * case.k]
    w = _randn((case.n, case.k), dtype, gen, device, case.k**-0.5)
    b = _randn((case.n,), dtype, gen, device) if case.bias else None
    before = x.clone()
    if case.kernel == "gemv":
        y = gemv_silu_and_mul(x, w, b)
    else:
        assert b is None, "silu_and_mul_linear has no bias"
        y = silu_and_mul_linear(x, w)
    assert torch.equal(x, before)
    assert y.shape == (case.rows, case.n) and y.dtype == dtype and y.is_contiguous()
    _close(y, SiluAndMul().forward_native(x), w, b, device)


INTERPRETED_NORM = [
    Case("nl_fp32_r1_k576_n40", "float32", 1, 576, 40),
    Case("nl_fp16_r5_k100_n33_bias_strided", "float16", 5, 100, 33, bias=True, strided=True),
    Case("nl_fp32_r16_k64_n16_nores", "float32", 16, 64, 16, residual=False),
    # One-row GEMV prologue: K over several BLOCK_K steps (2560 = 2.5 x 1024, masked)
    # and within one (even); N not a multiple of the 8-column tile; no residual.
    Case("gn_fp32_k2560_n37_bias", "float32", 1, 2560, 37, bias=True, kernel="gemv"),
    Case("gn_fp16_k1024_n24_strided", "float16", 1, 1024, 24, strided=True, kernel="gemv"),
    Case("gn_fp32_k100_n9_nores", "float32", 1, 100, 9, residual=False, kernel="gemv"),
]
INTERPRETED_SILU = [
    Case("sl_fp32_r3_k200_n24", "float32", 3, 200, 24),
    Case("sl_fp16_r16_k130_n17_strided", "float16", 16, 130, 17, strided=True),
    Case("gs_fp32_k1536_n40_bias", "float32", 1, 1536, 40, bias=True, kernel="gemv"),
    Case("gs_fp16_k100_n17_strided", "float16", 1, 100, 17, strided=True, kernel="gemv"),
]
CUDA_NORM = [
    *INTERPRETED_NORM,
    Case("nl_bf16_smollm2_qkv_r1", "bfloat16", 1, 576, 960),
    Case("nl_bf16_smollm2_gate_up_r16", "bfloat16", 16, 576, 3072),
    Case("nl_bf16_qwen_qkv_bias_r7", "bfloat16", 7, 896, 1152, bias=True),
    Case("nl_fp16_nores_r2_k2048", "float16", 2, 2048, 100, residual=False),
    Case("gn_bf16_smollm2_qkv", "bfloat16", 1, 576, 960, kernel="gemv"),
    Case("gn_bf16_smollm2_gate_up_nores", "bfloat16", 1, 576, 3072, residual=False,
         kernel="gemv"),
    Case("gn_bf16_qwen_qkv_bias", "bfloat16", 1, 896, 1152, bias=True, kernel="gemv"),
    Case("gn_bf16_llama3_8b_qkv", "bfloat16", 1, 4096, 6144, kernel="gemv"),
]
CUDA_SILU = [
    *INTERPRETED_SILU,
    Case("sl_bf16_smollm2_down_r1", "bfloat16", 1, 1536, 576),
    Case("sl_bf16_smollm2_down_r16", "bfloat16", 16, 1536, 576),
    Case("gs_bf16_smollm2_down", "bfloat16", 1, 1536, 576, kernel="gemv"),
    Case("gs_bf16_llama3_8b_down", "bfloat16", 1, 14336, 4096, kernel="gemv"),
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
    from vllm.model_executor.layers.ops.gemv import gemv_rms_norm, gemv_silu_and_mul
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
        (lambda: gemv_rms_norm(x, None, nw, 1e-5, w), "gemv_rms_norm: takes one row, got 3"),
        (lambda: gemv_rms_norm(x[:1], None, nw[:8], 1e-5, w), r"norm_weight must be \[64\]"),
        (lambda: gemv_rms_norm(x[:1], x[:1].half(), nw, 1e-5, w), "residual must match"),
        (lambda: gemv_rms_norm(x[:1], None, nw, 1e-5, w, torch.zeros(7)), r"bias must be \[8\]"),
        (lambda: gemv_rms_norm(x[:1], None, nw, 1e-5, w), "needs CUDA tensors"),
        (lambda: gemv_silu_and_mul(torch.zeros(1, 63), w), "must be even"),
        (lambda: gemv_silu_and_mul(torch.zeros(2, 128), w), "takes one row, got 2"),
        (lambda: gemv_silu_and_mul(torch.zeros(1, 64), w), r"weight \[N, K\]"),
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
    """Default: one row + small weight -> one GEMV launch with the prologue; a big weight
    -> norm + GEMV; 17 rows -> norm + cuBLAS. The tl.dot kernels switched on: 4 rows ->
    one launch; with GEMV_MAX_ROWS = 0 one row takes them too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm.model_executor.layers import fused_linear, linear
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
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
        down = RowParallelLinear(1536, 576, bias=False).to(torch.bfloat16)
        for layer in (small, big, down):
            layer.weight.data.normal_()
        rows = {m: (torch.randn(m, 576).bfloat16(), torch.randn(m, 576).bfloat16())
                for m in (1, 4, 17)}
        gate_up = torch.randn(1, 3072).bfloat16()

    def norm_project(layer, m):
        return kernels(lambda: fused_linear.norm_and_project(norm, layer, *rows[m]))

    for m in rows:  # compile outside the profiler
        fused_linear.norm_and_project(norm, small, *rows[m])
    fused_linear.norm_and_project(norm, big, *rows[1])
    fused_linear.act_and_project(SiluAndMul(), down, gate_up)
    torch.cuda.synchronize()
    if not kernels(lambda: rows[1][0] + 1):
        pytest.skip("the profiler records no CUDA kernels on this machine (CUPTI)")
    assert norm_project(small, 1) == ["_gemv_kernel"]
    assert kernels(lambda: fused_linear.act_and_project(SiluAndMul(), down, gate_up)) == [
        "_gemv_kernel"
    ]
    assert norm_project(big, 1) == ["_rms_norm_kernel", "_gemv_kernel"]
    for m in (4, 17):
        got = norm_project(small, m)
        assert got[0] == "_rms_norm_kernel" and len(got) >= 2, got
        assert not any("gemv" in k or "norm_linear" in k for k in got), got

    monkeypatch.setattr(fused_linear, "FUSED_LINEAR_MAX_TOKENS", MAX_ROWS)
    fused_linear.norm_and_project(norm, small, *rows[4])  # compile
    assert norm_project(small, 4) == ["_rms_norm_linear_kernel"]
    assert norm_project(small, 1) == ["_gemv_kernel"]
    got = norm_project(small, 17)
    assert not any("norm_linear" in k for k in got) and len(got) >= 2, got
    monkeypatch.setattr(linear, "GEMV_MAX_ROWS", 0)
    fused_linear.norm_and_project(norm, small, *rows[1])  # compile
    assert norm_project(small, 1) == ["_rms_norm_linear_kernel"]


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("rows", [1, 4])
def test_fused_layer_replays_under_cuda_graph(monkeypatch, rows: int) -> None:
    """Captured at 1 row (the GEMV prologues, on by default) and at 4 (the tl.dot kernels,
    switched on), replayed on new inputs: equals the unfused modules."""
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
        x, res = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()

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
        x.copy_(torch.randn(rows, 576).bfloat16())
        res.copy_(torch.randn(rows, 576).bfloat16())
        graph.replay()
        h, r = norm(x, res)
        ref = down(SiluAndMul()(gate_up(h)))
        assert torch.equal(new_res, r)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
