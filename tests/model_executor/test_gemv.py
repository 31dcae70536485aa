"""The skinny-projection GEMV (`layers/ops/gemv.py`) and its dispatch in `layers/linear.py`.

Reference: x @ W^T (+ b) in float64, so the only differences allowed are the
float32 sum order (a tolerance scaled by |x| @ |W|) and one output rounding.

CPU: cases run in one TRITON_INTERPRET=1 subprocess (fp32/fp16: the
interpreter's bf16 dot is unreliable), and the dispatch keeps CPU tensors on
`F.linear` bit for bit. CUDA (`-m cuda`): bf16 at the model shapes, the
dispatch (which kernel a layer launches at 1 and 2 rows), a captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.model_executor.test_fused_ops import _generator, _randn
from tests.model_executor.test_norm_linear import _close
from tests.triton_interpreter import check_result, needs_triton, run_checks, run_interpreted
from vllm import envs


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    rows: int
    k: int
    n: int
    bias: bool = False
    strided: bool = False  # x rows of a wider buffer
    block_n: int = 0  # 0: default_config
    block_k: int = 0


def check_gemv(case: Case, device: str) -> None:
    from vllm.model_executor.layers.ops.gemv import GemvConfig, gemv

    gen = _generator(case.name, device)
    dtype = getattr(torch, case.dtype)
    width = case.k + (8 if case.strided else 0)
    x = _randn((case.rows, width), dtype, gen, device, 2.0)[:, : case.k]
    w = _randn((case.n, case.k), dtype, gen, device, case.k**-0.5)
    b = _randn((case.n,), dtype, gen, device) if case.bias else None
    config = GemvConfig(case.block_n, case.block_k) if case.block_n else None
    before = x.clone()
    y = gemv(x, w, b, config=config)
    assert torch.equal(x, before), "inputs were modified"
    assert y.shape == (case.rows, case.n) and y.dtype == dtype and y.is_contiguous()
    _close(y, x, w, b, device)


INTERPRETED = [
    Case("fp32_r1_k576_n40", "float32", 1, 576, 40),  # K not a multiple of BLOCK_K
    Case("fp32_r1_k256_n37_bias_tile", "float32", 1, 256, 37, bias=True, block_n=16,
         block_k=64),  # N not a multiple of BLOCK_N, even K
    Case("fp16_r1_k100_n24_strided", "float16", 1, 100, 24, strided=True),
    Case("fp32_r5_k96_n33_bias", "float32", 5, 96, 33, bias=True),
    Case("fp16_r16_k64_n20_strided", "float16", 16, 64, 20, strided=True),
]
CUDA = [
    *INTERPRETED,
    Case("bf16_r1_smollm2_qkv", "bfloat16", 1, 576, 960),
    Case("bf16_r1_smollm2_down", "bfloat16", 1, 1536, 576),
    Case("bf16_r1_llama3_8b_o_bias", "bfloat16", 1, 4096, 4096, bias=True),
    Case("bf16_r1_llama3_8b_down", "bfloat16", 1, 14336, 4096),
    Case("bf16_r8_qwen_qkv_bias", "bfloat16", 8, 896, 1152, bias=True),
]


def _run_interpreted_cases() -> dict[str, str]:
    return run_checks(((check_gemv, INTERPRETED),), probe=True)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.model_executor.test_gemv", timeout_s=300)


@needs_triton
@pytest.mark.parametrize("name", [c.name for c in INTERPRETED])
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


@needs_triton
def test_gemv_rejects_bad_inputs() -> None:
    from vllm.model_executor.layers.ops.gemv import gemv

    x, w = torch.zeros(1, 64), torch.zeros(8, 64)
    cases = [
        (lambda: gemv(torch.zeros(17, 64), w), r"takes 1\.\.16 rows, got 17"),
        (lambda: gemv(torch.zeros(0, 64), w), r"got 0"),
        (lambda: gemv(x, torch.zeros(8, 32)), r"weight \[N, K\]"),
        (lambda: gemv(x, w.half()), "weight must be torch.float32"),
        (lambda: gemv(x, w, torch.zeros(7)), r"bias must be \[8\]"),
        (lambda: gemv(x, torch.zeros(64, 8).t()), "contiguous last dim"),
        (lambda: gemv(x.long(), w.long()), "x must be one of"),
        (lambda: gemv(x, w), "needs CUDA tensors"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@needs_triton
def test_gemv_does_not_specialise_on_the_batch() -> None:
    """Row count and row strides change per step: no compile on the request path (issue 10)."""
    from vllm.model_executor.layers.ops.gemv import _gemv_kernel

    flags = {p.name: p.do_not_specialize for p in _gemv_kernel.params}
    assert flags["num_rows"] and flags["stride_x"] and flags["stride_o"]
    assert not flags["K"] and not flags["stride_w"]  # fixed per layer: alignment helps loads


def test_cpu_layers_stay_on_f_linear() -> None:
    """On CPU every row count is exactly F.linear (the GEMV is CUDA only)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        RowParallelLinear,
        linear_forward,
    )

    torch.manual_seed(0)
    col, row = ColumnParallelLinear(32, 48, bias=True), RowParallelLinear(48, 32, bias=False)
    for layer in (col, row):
        for p in layer.parameters():
            p.data.normal_()
    for rows in (1, 2, 17, 32, 64):  # 32..64: cuBLASLt on NVIDIA GPUs only
        x = torch.randn(rows, 32)
        assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
        assert torch.equal(row(col(x)), F.linear(col(x), row.weight))
        assert torch.equal(linear_forward(x, col.weight), F.linear(x, col.weight))


# --- CUDA -------------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", CUDA, ids=lambda c: c.name)
def test_gemv_cuda(case: Case) -> None:
    check_gemv(case, "cuda")


@pytest.mark.cuda
@needs_triton
def test_dispatch_one_row_takes_the_gemv_in_a_graph_cuda(monkeypatch) -> None:
    """One row: the Triton kernel, also replayed from a CUDA graph with new inputs;
    two rows, or GEMV_MAX_ROWS = 0: cuBLAS, bit-identical to F.linear."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    torch.manual_seed(0)
    layer = ColumnParallelLinear(4096, 6144, bias=False).to("cuda", torch.bfloat16)
    layer.weight.data.normal_(std=4096**-0.5)

    def kernels(x: torch.Tensor) -> list[str]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(x)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    one, two = torch.randn(1, 4096, device="cuda").bfloat16(), torch.randn(2, 4096).bfloat16()
    assert kernels(one) == ["_gemv_kernel"]
    assert torch.equal(layer(two.cuda()), F.linear(two.cuda(), layer.weight))
    monkeypatch.setattr(linear, "GEMV_MAX_ROWS", 0)
    assert "_gemv_kernel" not in kernels(one)
    assert torch.equal(layer(one), F.linear(one, layer.weight))
    monkeypatch.setattr(linear, "GEMV_MAX_ROWS", 1)

    static_x = one.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    for _ in range(2):
        static_x.copy_(torch.randn(1, 4096, device="cuda").bfloat16())
        graph.replay()
        _close(static_y, static_x, layer.weight, None, "cuda")


@pytest.mark.cuda
def test_dispatch_32_to_64_rows_ask_for_cublaslt_cuda(monkeypatch) -> None:
    """Rows in CUBLASLT_ROWS run F.linear under cuBLASLt (in a graph too), then the
    preference is restored; other row counts never touch it."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    if torch.version.cuda is None:
        pytest.skip("cuBLASLt is the NVIDIA build's library")
    torch.manual_seed(0)
    layer = RowParallelLinear(4096, 4096, bias=False).to("cuda", torch.bfloat16)
    layer.weight.data.normal_(std=4096**-0.5)
    asked = []
    real = torch.backends.cuda.preferred_blas_library

    def spy(backend=None):
        asked.append(backend if backend is None or isinstance(backend, str) else backend.name)
        return real(backend)

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", spy)
    before = real()
    for rows in (2, 31, 32, 48, 64, 65, 256):
        x = torch.randn(rows, 4096, device="cuda").bfloat16()
        asked.clear()
        y = layer(x)
        assert (asked == [None, "cublaslt", "Cublas"]) == (32 <= rows <= 64), (rows, asked)
        assert real() == before
        _close(y, x, layer.weight, None, "cuda")
    static_x = torch.randn(32, 4096, device="cuda").bfloat16()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(torch.randn(32, 4096, device="cuda").bfloat16())
    graph.replay()
    _close(static_y, static_x, layer.weight, None, "cuda")


def test_dependent_launch_switch(monkeypatch) -> None:
    """VLLM_GEMV_PDL turns programmatic dependent launch off; a CUDA launch option only,
    for weights up to PDL_MAX_WEIGHT_BYTES, never on ROCm; a bad value is an error."""
    from vllm.model_executor.layers.ops.gemv import PDL_MAX_WEIGHT_BYTES, dependent_launch

    assert not dependent_launch(torch.device("cpu"))  # a CUDA launch option only
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as NVIDIA builds say (CI's is CPU)
    monkeypatch.setenv("VLLM_GEMV_PDL", "0")
    assert not dependent_launch(torch.device("cuda"))  # off: the device is not even asked
    monkeypatch.setenv("VLLM_GEMV_PDL", "1")
    envs.reset()  # parsed once per process: read the new value
    assert not dependent_launch(torch.device("cuda"), PDL_MAX_WEIGHT_BYTES + 1)  # too large
    monkeypatch.setenv("VLLM_GEMV_PDL", "maybe")
    envs.reset()
    with pytest.raises(ValueError, match="VLLM_GEMV_PDL must be 1/true/on or 0/false/off, "
                                         "got 'maybe'"):
        dependent_launch(torch.device("cuda"), 1 << 20)
    monkeypatch.setattr(torch.version, "cuda", None)  # ROCm's torch: no griddepcontrol
    assert not dependent_launch(torch.device("cuda"), 1 << 20)


@pytest.mark.cuda
def test_dependent_launch_chain_in_a_graph_equals_plain_launches_cuda(monkeypatch) -> None:
    """Eleven one-row GEMVs, each reading the one before's output (with the norm and
    SiLU prologues), captured in a CUDA graph with programmatic dependent launch: a
    launch that read its input before the previous kernel finished would differ from
    the same chain launched plainly (the kernels' math is the same, so bit for bit).
    Every launch of the "1" runs asked Triton for PDL, none of the "0" runs did."""
    from vllm.model_executor.layers.ops import gemv as gemv_module
    from vllm.model_executor.layers.ops.gemv import (
        PDL_MAX_WEIGHT_BYTES,
        dependent_launch,
        gemv,
        gemv_rms_norm,
        gemv_silu_and_mul,
    )

    asked = []  # (launch_pdl option, USE_PDL constexpr) of every launch
    real_run = gemv_module._gemv_kernel.run

    def spy(*args, **kwargs):
        asked.append((kwargs.get("launch_pdl", False), kwargs["USE_PDL"]))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(gemv_module._gemv_kernel, "run", spy)

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = 576  # SmolLM2-135M's hidden size: its weights take the dependent launch
    weights = [torch.randn(k, k, generator=gen, device="cuda").bfloat16() * k**-0.5
               for _ in range(6)]
    gate_up = torch.randn(2 * k, k, generator=gen, device="cuda").bfloat16() * k**-0.5
    norm_w = torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5
    assert gate_up.numel() * 2 <= PDL_MAX_WEIGHT_BYTES

    def chain(x: torch.Tensor) -> torch.Tensor:
        residual = x
        for i, w in enumerate(weights):
            y = gemv(x, w)
            if i % 2:
                y, residual = gemv_rms_norm(y, residual, norm_w, 1e-6, w)
            x = y
        return gemv_silu_and_mul(gemv(x, gate_up), weights[0])

    outputs = {}
    for flag in ("0", "1"):
        asked.clear()
        monkeypatch.setenv("VLLM_GEMV_PDL", flag)
        envs.reset()  # parsed once per process: read the new value
        if flag == "1" and not dependent_launch(torch.device("cuda"), k * k * 2):
            pytest.skip("programmatic dependent launch needs compute capability 9.0+")
        static_x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
        chain(static_x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = chain(static_x)
        runs = []
        for seed in range(3):
            x = torch.randn(1, k, generator=torch.Generator(device="cuda").manual_seed(seed),
                            device="cuda").bfloat16()
            static_x.copy_(x)
            graph.replay()
            runs.append(static_y.clone())
            assert torch.equal(chain(x), runs[-1])  # eager launches, the same
        outputs[flag] = torch.cat(runs)
        assert len(asked) >= 11 and set(asked) == {(flag == "1", flag == "1")}
    assert torch.isfinite(outputs["1"].float()).all()
    assert torch.equal(outputs["1"], outputs["0"])
