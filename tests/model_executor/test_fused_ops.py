"""The fused Triton kernels (RMSNorm, rotary embedding, SiLU-and-mul) against the torch path.

Each check builds the layer, runs `forward_cuda` (the Triton launch) and
`forward_native` (the torch code, the reference) on the same inputs, and
compares them; inputs are also checked to be left untouched.

* CPU (CI): the Triton interpreter. TRITON_INTERPRET=1 must be set before the
  kernels are decorated, so the interpreted cases run in ONE subprocess
  (tests/triton_interpreter.py) that prints one JSON line; each
  parametrised test checks its own entry. The Triton 3.9 interpreter rounds
  float32 -> bfloat16 casts toward zero (GPUs round to nearest even), so
  interpreted bf16 cases are checked with a tolerance; fp32/fp16 are exact or
  ulp-tight there too.
* CUDA (marker `cuda`): the sweep over odd sizes in fp32/bf16/fp16 with the
  tight rules, one-kernel-per-call through the layers' `forward`, and replay
  under a captured CUDA graph.

Rules (what is true, and why):
  rotary       exact in every dtype: the kernel rounds each product and sum
               where torch does, with FMA contraction off.
  rms_norm     the new residual is exact; the output is within 1 ulp with a
               unit weight (only the float32 sum order of the mean differs) and
               within 2 ulp with a random one (a 1-ulp difference in the
               normalised value can become 2 after the weight multiply); >= 99%
               of values identical.
  silu_and_mul Triton's exp vs torch's: float32 within 1e-5, half types within
               2 ulp with >= 99% identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

from tests.triton_interpreter import (
    REPO_ROOT,
    check_result,
    needs_triton,
    run_checks,
    run_interpreted,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.ops import use_fused_ops
from vllm.model_executor.layers.rotary_embedding import get_rope

_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _generator(name: str, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))


def _randn(shape, dtype, gen, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values lie between a and b (same dtype)."""
    int_dtype = torch.int32 if a.dtype == torch.float32 else torch.int16
    mag_mask = 0x7FFFFFFF if a.dtype == torch.float32 else 0x7FFF

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(int_dtype).long()
        magnitude = bits & mag_mask
        return torch.where(bits < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(
    got: torch.Tensor, ref: torch.Tensor, device: str, *, exact: bool = False, max_ulps: int = 2
) -> None:
    """The comparison rules of the module docstring; raises AssertionError."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"got {got.dtype} {tuple(got.shape)}, expected {ref.dtype} {tuple(ref.shape)}"
    )
    if got.dtype == torch.bfloat16 and device == "cpu":  # interpreter: truncating casts
        torch.testing.assert_close(got.float(), ref.float(), atol=6e-2, rtol=3e-2)
        return
    if exact:
        err = (got.float() - ref.float()).abs().max().item()
        assert torch.equal(got, ref), f"not bit-identical, max error {err}"
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
        return
    dist = _ulp_distance(got, ref)
    assert int(dist.max()) <= max_ulps, f"{int(dist.max())} ulps apart (allowed {max_ulps})"
    same = (dist == 0).float().mean().item()
    assert same >= 0.99, f"only {same:.4f} of the values are identical"


def assert_matches_promoted(
    got: torch.Tensor, ref: torch.Tensor, rounded_to: torch.dtype, device: str
) -> None:
    """For outputs promoted past the dtype an intermediate was rounded to (a float32
    weight on bf16/fp16 activations): that rounding may differ by one of its ulps."""
    if rounded_to == torch.bfloat16 and device == "cpu":  # interpreter: truncating casts
        torch.testing.assert_close(got, ref, atol=6e-2, rtol=3e-2)
        return
    ulp = torch.finfo(rounded_to).eps  # relative spacing at the bottom of a binade
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=ulp)
    same = (got == ref).float().mean().item()
    assert same >= 0.99, f"only {same:.4f} of the values are identical"


# --- checks (run on "cpu" under the interpreter, or on "cuda") -------------------------------
@dataclass(frozen=True)
class NormCase:
    name: str
    dtype: str
    hidden: int
    lead: tuple[int, ...]  # leading dims of x
    residual: bool
    # contiguous | strided (wider rows) | heads (Qwen3 q-norm view) | padded_heads
    layout: str = "contiguous"
    weight_dtype: str = ""  # "" = x's dtype
    unit_weight: bool = False


def _norm_input(case: NormCase, gen, device, pad: int = 3) -> torch.Tensor:
    """x (or the residual, with another `pad`: its own strides) in the case's layout."""
    dtype = getattr(torch, case.dtype)
    if case.layout == "strided":
        (num_tokens,) = case.lead
        rows = _randn((num_tokens, case.hidden + 2 * pad), dtype, gen, device, 2.0)
        return rows[:, pad : pad + case.hidden]
    if case.layout == "heads":  # q = qkv[:, :H*D] viewed as [T, H, D]: rows 2 strides apart
        num_tokens, num_heads = case.lead
        qkv = _randn((num_tokens, (num_heads + 2) * case.hidden), dtype, gen, device, 2.0)
        return qkv[:, : num_heads * case.hidden].reshape(num_tokens, num_heads, case.hidden)
    if case.layout == "padded_heads":  # [T, H, D] with `pad` unused features after each head
        return _randn((*case.lead, case.hidden + pad), dtype, gen, device, 2.0)[..., : case.hidden]
    return _randn((*case.lead, case.hidden), dtype, gen, device, 2.0)


def check_rms_norm(case: NormCase, device: str) -> None:
    gen = _generator(case.name, device)
    norm = RMSNorm(case.hidden, eps=1e-5).to(getattr(torch, case.weight_dtype or case.dtype))
    norm = norm.to(device)
    if not case.unit_weight:
        norm.weight.data.copy_(_randn((case.hidden,), torch.float32, gen, device))
    x = _norm_input(case, gen, device)
    x_before = x.clone()
    max_ulps = 1 if case.unit_weight else 2
    if not case.residual:
        got, ref = norm.forward_cuda(x), norm.forward_native(x)
        assert got.is_contiguous()
    else:
        residual = _norm_input(case, gen, device, pad=1)
        residual_before = residual.clone()
        got, got_residual = norm.forward_cuda(x, residual)
        ref, ref_residual = norm.forward_native(x, residual)
        assert_matches(got_residual, ref_residual, device, exact=True)
        assert torch.equal(residual, residual_before), "residual was modified"
    if ref.dtype != x.dtype:  # a float32 weight: the normalised value is rounded to x's dtype
        assert got.dtype == ref.dtype
        assert_matches_promoted(got, ref, x.dtype, device)
    else:
        assert_matches(got, ref, device, max_ulps=max_ulps)
    assert torch.equal(x, x_before), "x was modified"


@dataclass(frozen=True)
class RopeCase:
    name: str
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary_dim: int
    num_tokens: int
    neox: bool = True
    llama3: bool = False
    fused_qkv: bool = True  # query/key are slices of one qkv row (row stride > width)
    positions_dtype: str = "int64"
    max_position: int = 300


def _rope_inputs(case: RopeCase, gen, device):
    dtype = getattr(torch, case.dtype)
    t, d = case.num_tokens, case.head_size
    q_size, kv_size = case.num_heads * d, case.num_kv_heads * d
    if case.fused_qkv:
        qkv = _randn((t, q_size + 2 * kv_size), dtype, gen, device)
        query, key, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    else:
        query, key = (
            _randn((t, q_size), dtype, gen, device),
            _randn((t, kv_size), dtype, gen, device),
        )
    positions = torch.randint(0, case.max_position, (t,), generator=gen, device=device)
    positions[0], positions[-1] = case.max_position - 1, 0  # both ends of the cache
    return positions.to(getattr(torch, case.positions_dtype)), query, key


def _rope(case: RopeCase, device: str):
    scaling = {**_LLAMA3_SCALING} if case.llama3 else None
    rope = get_rope(case.head_size, case.rotary_dim, case.max_position, 10000.0, scaling, case.neox)
    return rope.to(device)


def check_rotary(case: RopeCase, device: str) -> None:
    gen = _generator(case.name, device)
    rope = _rope(case, device)
    positions, query, key = _rope_inputs(case, gen, device)
    q_before, k_before = query.clone(), key.clone()
    q, k = rope.forward_cuda(positions, query, key)
    q_ref, k_ref = rope.forward_native(positions, query, key)
    assert_matches(q, q_ref, device, exact=True)
    assert_matches(k, k_ref, device, exact=True)
    assert torch.equal(query, q_before) and torch.equal(key, k_before), "inputs were modified"
    assert not torch.equal(q, query)  # the rotation did something


def check_rotary_out_of_range(case: RopeCase, device: str) -> None:
    """A position past the cache rotates to NaN and reads nothing; other tokens are exact."""
    gen = _generator(case.name, device)
    rope = _rope(case, device)
    positions, query, key = _rope_inputs(case, gen, device)
    bad = positions.clone()
    bad[1], bad[2] = case.max_position, -1
    q, k = rope.forward_cuda(bad, query, key)
    q_ref, k_ref = rope.forward_native(positions, query, key)
    good = torch.ones(case.num_tokens, dtype=torch.bool, device=device)
    good[1:3] = False
    assert_matches(q[good], q_ref[good], device, exact=True)
    assert_matches(k[good], k_ref[good], device, exact=True)
    for out, src, heads in ((q, query, case.num_heads), (k, key, case.num_kv_heads)):
        rows = out[~good].view(2, heads, case.head_size)
        assert torch.isnan(rows[..., : case.rotary_dim]).all()
        src_rows = src[~good].reshape(2, heads, case.head_size)
        assert torch.equal(rows[..., case.rotary_dim :], src_rows[..., case.rotary_dim :])


@dataclass(frozen=True)
class SiluCase:
    name: str
    dtype: str
    d: int
    lead: tuple[int, ...]
    strided: bool = False  # rows of a wider buffer


def check_silu_and_mul(case: SiluCase, device: str) -> None:
    gen = _generator(case.name, device)
    dtype = getattr(torch, case.dtype)
    if case.strided:
        x = _randn((*case.lead, 2 * case.d + 7), dtype, gen, device, 4.0)[..., : 2 * case.d]
    else:
        x = _randn((*case.lead, 2 * case.d), dtype, gen, device, 4.0)
    x_before = x.clone()
    act = SiluAndMul()
    assert_matches(act.forward_cuda(x), act.forward_native(x), device)
    assert torch.equal(x, x_before)


# Small on purpose: the interpreter runs every program in Python.
INTERPRETED_NORM = [
    NormCase("norm_fp32_h100_res", "float32", 100, (7,), True),
    NormCase("norm_fp16_h64", "float16", 64, (3,), False),
    NormCase("norm_fp16_h576_res_strided", "float16", 576, (4,), True, "strided"),
    NormCase("norm_bf16_h576_res_strided", "bfloat16", 576, (4,), True, "strided"),
    NormCase("norm_fp32_heads_d24", "float32", 24, (3, 4), False, "heads"),
    NormCase("norm_fp16_padded_heads_res", "float16", 20, (3, 5), True, "padded_heads"),
    NormCase("norm_fp16_4d_res", "float16", 40, (2, 3, 2), True),
    NormCase("norm_fp16_x_fp32_weight", "float16", 72, (5,), True, weight_dtype="float32"),
    NormCase("norm_fp16_unit_weight", "float16", 5120, (2,), True, unit_weight=True),
]
INTERPRETED_ROPE = [
    RopeCase("rope_fp32_neox_gqa2_d32", "float32", 4, 2, 32, 32, 9),
    RopeCase("rope_fp16_gptj_partial_d24", "float16", 3, 1, 24, 16, 5, neox=False),
    RopeCase(
        "rope_fp16_llama3_int32", "float16", 5, 1, 16, 16, 6, llama3=True, positions_dtype="int32"
    ),
    RopeCase("rope_bf16_neox_partial", "bfloat16", 4, 2, 32, 8, 4),
    RopeCase("rope_fp32_contiguous_tiles", "float32", 70, 3, 64, 64, 2, fused_qkv=False),
]
INTERPRETED_ROPE_RANGE = [RopeCase("rope_range_fp32_partial", "float32", 2, 1, 24, 16, 5)]
INTERPRETED_SILU = [
    SiluCase("silu_fp32_d1100", "float32", 1100, (5,)),
    SiluCase("silu_fp16_d5_3d", "float16", 5, (2, 3)),
    SiluCase("silu_bf16_d64_strided", "bfloat16", 64, (6,), strided=True),
    SiluCase("silu_fp16_d300_strided", "float16", 300, (3,), strided=True),
]


def _run_interpreted_cases() -> dict[str, str]:
    """Run every interpreted case on the CPU; name -> "ok" or the traceback."""
    return run_checks(
        (
            (check_rms_norm, INTERPRETED_NORM),
            (check_rotary, INTERPRETED_ROPE),
            (check_rotary_out_of_range, INTERPRETED_ROPE_RANGE),
            (check_silu_and_mul, INTERPRETED_SILU),
        )
    )


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.model_executor.test_fused_ops", timeout_s=300)


_INTERPRETED_NAMES = [
    c.name for c in INTERPRETED_NORM + INTERPRETED_ROPE + INTERPRETED_ROPE_RANGE + INTERPRETED_SILU
]


@needs_triton
@pytest.mark.parametrize("name", _INTERPRETED_NAMES)
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


# --- CPU: dispatch and launcher errors --------------------------------------------------------
def test_cpu_layers_take_the_torch_path_without_importing_triton() -> None:
    """CPU tensors never reach Triton: the kernel modules (and triton) stay unimported."""
    code = (
        "import sys, torch\n"
        "from vllm.model_executor.layers.layernorm import RMSNorm\n"
        "from vllm.model_executor.layers.activation import SiluAndMul\n"
        "from vllm.model_executor.layers.rotary_embedding import get_rope\n"
        "x = torch.randn(3, 64)\n"
        "y, r = RMSNorm(64)(x, x)\n"
        "a = SiluAndMul()(x)\n"
        "q, k = get_rope(16, 16, 32, 1e4)(torch.arange(3), x, x[:, :32])\n"
        "assert a.shape == (3, 32) and q.shape == (3, 64) and k.shape == (3, 32)\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or '.layers.ops.' in m))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
    assert not use_fused_ops(torch.zeros(2))


@needs_triton
def test_launchers_reject_bad_inputs() -> None:
    from vllm.model_executor.layers.ops.activation import silu_and_mul
    from vllm.model_executor.layers.ops.rms_norm import fused_add_rms_norm, rms_norm
    from vllm.model_executor.layers.ops.rotary import rotary_embedding

    x, w = torch.zeros(4, 64), torch.ones(64)
    with pytest.raises(ValueError, match=r"residual must match x.*\(4, 32\).*\(4, 64\)"):
        fused_add_rms_norm(x, torch.zeros(4, 32), w, 1e-6)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[64\], got \(65,\)"):
        rms_norm(x, torch.ones(65), 1e-6)
    with pytest.raises(ValueError, match="float64"):
        rms_norm(x.double(), w, 1e-6)
    with pytest.raises(ValueError, match=r"contiguous last dim, got strides \(1, 64\)"):
        rms_norm(x.t(), torch.ones(4), 1e-6)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs CUDA tensors.*device cpu"):
            rms_norm(x, w, 1e-6)
    with pytest.raises(ValueError, match=r"even last dim, got \(4, 5\)"):
        silu_and_mul(torch.zeros(4, 5))
    pos, cache = torch.zeros(4, dtype=torch.int64), torch.zeros(10, 16)
    with pytest.raises(ValueError, match=r"query must be \[4, heads \* 24\].*\(4, 64\)"):
        rotary_embedding(pos, x, x[:, :48], cache, 24)
    with pytest.raises(ValueError, match=r"positions must be \[num_tokens\].*\(2, 2\)"):
        rotary_embedding(pos.view(2, 2), x, x, cache, 16)
    with pytest.raises(ValueError, match=r"rotary_dim even and <= head_size \(16\).*\(10, 18\)"):
        rotary_embedding(pos, x, x, torch.zeros(10, 18), 16)
    with pytest.raises(ValueError, match="key must have query's dtype"):
        rotary_embedding(pos, x, x.half(), cache, 16)


# --- CUDA: the sweep, one launch per call, graph replay --------------------------------------
def _cuda_norm_cases() -> list[NormCase]:
    cases = []
    for dtype in ("float32", "bfloat16", "float16"):
        for hidden, lead in ((64, (1,)), (576, (37,)), (1000, (17,)), (4096, (300,)), (5120, (3,))):
            for residual in (False, True):
                tag = f"{dtype}_h{hidden}_t{lead[0]}_{'res' if residual else 'plain'}"
                cases.append(NormCase(f"norm_{tag}", dtype, hidden, lead, residual))
        cases += [
            NormCase(f"norm_{dtype}_strided_res", dtype, 4096, (9,), True, "strided"),
            NormCase(f"norm_{dtype}_qk_heads_d128", dtype, 128, (33, 32), False, "heads"),
            NormCase(f"norm_{dtype}_heads_d24", dtype, 24, (5, 3), False, "heads"),
            NormCase(f"norm_{dtype}_padded_heads_res", dtype, 64, (7, 3), True, "padded_heads"),
            NormCase(f"norm_{dtype}_unit_weight", dtype, 4096, (64,), True, unit_weight=True),
        ]
    cases.append(
        NormCase("norm_bf16_x_fp32_weight", "bfloat16", 576, (7,), True, weight_dtype="float32")
    )
    return cases


def _cuda_rope_cases() -> list[RopeCase]:
    cases = []
    for dtype in ("float32", "bfloat16", "float16"):
        cases += [
            RopeCase(
                f"rope_{dtype}_llama3_8b",
                dtype,
                32,
                8,
                128,
                128,
                300,
                llama3=True,
                max_position=8192,
            ),
            RopeCase(f"rope_{dtype}_d64", dtype, 4, 2, 64, 64, 33),
            RopeCase(f"rope_{dtype}_d24_mqa", dtype, 3, 1, 24, 24, 5, fused_qkv=False),
            RopeCase(f"rope_{dtype}_partial", dtype, 5, 1, 32, 16, 7, positions_dtype="int32"),
            RopeCase(f"rope_{dtype}_gptj_d16", dtype, 2, 2, 16, 16, 9, neox=False),
            RopeCase(f"rope_{dtype}_many_heads", dtype, 80, 16, 128, 128, 3),
        ]
    return cases


def _cuda_silu_cases() -> list[SiluCase]:
    cases = []
    for dtype in ("float32", "bfloat16", "float16"):
        cases += [
            SiluCase(f"silu_{dtype}_d14336", dtype, 14336, (3,)),
            SiluCase(f"silu_{dtype}_d1000", dtype, 1000, (37,)),
            SiluCase(f"silu_{dtype}_d5_3d", dtype, 5, (2, 4)),
            SiluCase(f"silu_{dtype}_d64_strided", dtype, 64, (9,), strided=True),
        ]
    return cases


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", _cuda_norm_cases(), ids=lambda c: c.name)
def test_rms_norm_cuda(case: NormCase) -> None:
    check_rms_norm(case, "cuda")


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", _cuda_rope_cases(), ids=lambda c: c.name)
def test_rotary_cuda(case: RopeCase) -> None:
    check_rotary(case, "cuda")


@pytest.mark.cuda
@needs_triton
def test_rotary_out_of_range_cuda() -> None:
    check_rotary_out_of_range(RopeCase("rope_range_bf16", "bfloat16", 4, 2, 32, 16, 6), "cuda")


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", _cuda_silu_cases(), ids=lambda c: c.name)
def test_silu_and_mul_cuda(case: SiluCase) -> None:
    check_silu_and_mul(case, "cuda")


def _llama_like_layers(dtype: torch.dtype):
    """RMSNorm 576, rope 4 x 2 heads of 64 (llama3), SiluAndMul; inputs [T, ...] for T = 5."""
    gen = _generator("layers", "cuda")
    norm = RMSNorm(576, 1e-5).to(dtype).cuda()
    norm.weight.data.copy_(_randn((576,), dtype, gen, "cuda"))
    rope = get_rope(64, 64, 1024, 5e5, dict(_LLAMA3_SCALING), True).cuda()
    inputs = dict(
        x=_randn((5, 576), dtype, gen, "cuda"),
        residual=_randn((5, 576), dtype, gen, "cuda"),
        qkv=_randn((5, 8 * 64), dtype, gen, "cuda"),
        positions=torch.randint(0, 1024, (5,), generator=gen, device="cuda"),
        gate_up=_randn((5, 2 * 1000), dtype, gen, "cuda"),
    )
    return norm, rope, SiluAndMul(), inputs


def _run_layers(norm, rope, act, inputs, native: bool = False):
    query, key, _ = inputs["qkv"].split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    if native:
        normed, residual = norm.forward_native(inputs["x"], inputs["residual"])
        q, k = rope.forward_native(inputs["positions"], query, key)
        return normed, residual, q, k, act.forward_native(inputs["gate_up"])
    normed, residual = norm(inputs["x"], inputs["residual"])
    q, k = rope(inputs["positions"], query, key)
    return normed, residual, q, k, act(inputs["gate_up"])


@pytest.mark.cuda
@needs_triton
def test_layers_launch_one_kernel_each_on_cuda() -> None:
    """`forward` on CUDA dispatches to the fused kernel: exactly one launch per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    norm, rope, act, inputs = _llama_like_layers(torch.bfloat16)
    _run_layers(norm, rope, act, inputs)  # compile outside the profile
    torch.cuda.synchronize()

    def kernels(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    if not kernels(lambda: inputs["x"] + 1):
        pytest.skip("the profiler records no CUDA kernels on this machine (CUPTI)")
    query, key, _ = inputs["qkv"].split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    seen = {
        "_rms_norm_kernel": kernels(lambda: norm(inputs["x"], inputs["residual"])),
        "_rotary_embedding_kernel": kernels(lambda: rope(inputs["positions"], query, key)),
        "_silu_and_mul_kernel": kernels(lambda: act(inputs["gate_up"])),
    }
    for name, launched in seen.items():
        assert len(launched) == 1 and name in launched[0], (name, launched)
    assert len(kernels(lambda: norm.forward_native(inputs["x"], inputs["residual"]))) > 1


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_replay_under_cuda_graph(dtype: torch.dtype) -> None:
    """Captured once, replayed on new inputs copied into the static buffers: still correct."""
    norm, rope, act, inputs = _llama_like_layers(dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run_layers(norm, rope, act, inputs)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _run_layers(norm, rope, act, inputs)
    gen = _generator("replay", "cuda")
    for _ in range(2):
        for name, t in inputs.items():
            if name == "positions":
                t.copy_(torch.randint(0, 1024, t.shape, generator=gen, device="cuda"))
            else:
                t.copy_(_randn(t.shape, dtype, gen, "cuda"))
        graph.replay()
        expected = _run_layers(norm, rope, act, inputs, native=True)
        for got, ref in zip(outputs, expected, strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            else:
                assert int(_ulp_distance(got, ref).max()) <= 2
