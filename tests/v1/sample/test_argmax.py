"""The chunked greedy argmax (`vllm/v1/sample/ops/argmax.py`) and the sampler's raw-logits path.

Reference: `torch.argmax` of the float32 logits (first column on ties, NaN
largest). CPU: cases run in one TRITON_INTERPRET=1 subprocess; CUDA (`-m cuda`):
the same cases plus the model shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.triton_interpreter import check_result, needs_triton, run_checks, run_interpreted
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.metadata import build_sampling_metadata
from vllm.v1.sample.sampler import Sampler, argmax_rows


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    rows: int
    vocab: int
    special: str = ""  # "ties" | "nan" | "zeros" | "neg_inf" | "negative" | "strided"


def _logits(case: Case, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.rows * 100003 + case.vocab)
    width = case.vocab + (13 if case.special == "strided" else 0)
    x = torch.randn(case.rows, width, generator=g) * 4
    v = case.vocab
    if case.special == "ties":  # the max at three columns, one in a later chunk
        x[:, [v // 3, v // 2, v - 1]] = 100.0
    elif case.special == "nan":  # the first NaN wins, even over +inf
        x[:, v - 1] = float("inf")
        x[:, [v // 2, v - 2]] = float("nan")
    elif case.special == "zeros":  # -0.0 before +0.0: equal, so the first
        x[:] = -1.0
        x[:, v // 2] = -0.0
        x[:, v - 1] = 0.0
    elif case.special == "neg_inf":
        x[:] = float("-inf")
    elif case.special == "negative":
        x = -x.abs() - 1.0
    x = x.to(getattr(torch, case.dtype)).to(device)
    return x[:, :v] if case.special == "strided" else x


def check_argmax(case: Case, device: str) -> None:
    from vllm.v1.sample.ops.argmax import greedy_argmax

    logits = _logits(case, device)
    before = logits.clone()
    got = greedy_argmax(logits)
    want = logits.float().argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == (case.rows,)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(logits.nan_to_num(), before.nan_to_num()), "logits were modified"


INTERPRETED = [
    Case("fp32_r3_v5000", "float32", 3, 5000),
    Case("bf16_r2_v4097_ties", "bfloat16", 2, 4097, "ties"),  # one column past two chunks
    Case("fp16_r2_v3000_nan", "float16", 2, 3000, "nan"),
    Case("fp32_r1_v2049_zeros", "float32", 1, 2049, "zeros"),
    Case("bf16_r2_v100_neg_inf", "bfloat16", 2, 100, "neg_inf"),
    Case("fp32_r4_v2048_negative", "float32", 4, 2048, "negative"),
    Case("bf16_r3_v999_strided", "bfloat16", 3, 999, "strided"),
    Case("fp32_r2_v1", "float32", 2, 1),
]
CUDA = [
    *INTERPRETED,
    Case("bf16_r1_smollm2", "bfloat16", 1, 49152),
    Case("bf16_r32_llama3", "bfloat16", 32, 128256, "ties"),
    Case("fp32_r32_llama3", "float32", 32, 128256),
    Case("bf16_r7_qwen2_nan", "bfloat16", 7, 151936, "nan"),
]


def _run_interpreted_cases() -> dict[str, str]:
    return run_checks(((check_argmax, INTERPRETED),))


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.v1.sample.test_argmax", timeout_s=300)


@needs_triton
@pytest.mark.parametrize("name", [c.name for c in INTERPRETED])
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


@needs_triton
def test_greedy_argmax_rejects_bad_inputs() -> None:
    from vllm.v1.sample.ops.argmax import greedy_argmax

    cases = [
        (torch.zeros(4, 8), "needs CUDA tensors"),
    ]
    for logits, message in cases:
        with pytest.raises(ValueError, match=message):
            greedy_argmax(logits)


def _greedy_metadata(n: int, vocab: int, **params) -> object:
    return build_sampling_metadata([SamplingParams(temperature=0, **params)] * n, [[1]] * n,
                                   [[2, 3]] * n, {}, vocab, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampler_greedy_on_raw_logits_equals_float32(dtype) -> None:
    """An all-greedy batch samples the raw logits; ties after rounding pick what float32 picks."""
    torch.manual_seed(0)
    logits = (torch.randn(6, 300) * 3).to(dtype)
    logits[:, 7] = logits[:, 200] = logits.float().max() + 1  # tie, first wins
    logits[5, :] = -1.0
    want = logits.float().argmax(dim=-1)
    assert want[0] == 7 and want[5] == 0
    out = Sampler()(logits.clone(), _greedy_metadata(6, 300))
    assert torch.equal(out.sampled_token_ids, want) and out.logprobs_tensors is None
    # With a logits processor or logprobs the float32 path runs: the penalty moves the argmax.
    out = Sampler()(logits.clone(), _greedy_metadata(6, 300, repetition_penalty=1e6))
    assert torch.equal(out.sampled_token_ids, want)  # 7 / 200 were not generated: unchanged
    penalised = logits.clone()
    penalised[:, 2] = 1e4
    out = Sampler()(penalised, _greedy_metadata(6, 300, repetition_penalty=1e6))
    assert not torch.equal(out.sampled_token_ids, torch.full((6,), 2))  # token 2 penalised
    with_logprobs = Sampler()(logits.clone(), _greedy_metadata(6, 300, logprobs=2))
    assert torch.equal(with_logprobs.sampled_token_ids, want)
    assert with_logprobs.logprobs_tensors is not None


def test_argmax_rows_on_cpu_is_torch() -> None:
    logits = torch.randn(3, 17).to(torch.bfloat16)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


# --- CUDA -------------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", CUDA, ids=lambda c: c.name)
def test_cuda(case: Case) -> None:
    check_argmax(case, "cuda")


@pytest.mark.cuda
@needs_triton
def test_cuda_rejects_and_dispatches() -> None:
    from vllm.v1.sample.ops.argmax import greedy_argmax

    logits = torch.randn(4, 64, device="cuda")
    for bad, message in ((logits.t(), "contiguous last dim"), (logits[0], r"\[N, V\]"),
                         (logits[:0], r"\[N, V\]"), (logits.long(), "logits must be one of")):
        with pytest.raises(ValueError, match=message):
            greedy_argmax(bad)
    # argmax_rows: a transposed view goes to torch.argmax, the same answer.
    assert torch.equal(argmax_rows(logits.t()), logits.t().argmax(dim=-1))


@pytest.mark.cuda
@needs_triton
def test_cuda_compiled_launches_follow_each_specialisation() -> None:
    """After the first call of a specialisation, launches skip Triton's dispatch
    (ops/launch.py); every later call must still run the variant its arguments need."""
    from vllm.v1.sample.ops import argmax as argmax_module

    gen = torch.Generator(device="cuda").manual_seed(3)
    wide = torch.randn(8, 4097, device="cuda", generator=gen).to(torch.bfloat16)
    cases = [
        wide[:, :4096],  # stride 4097: not a multiple of 16
        wide[:, 1:],  # data pointer 2 bytes past alignment
        wide[:3, :4096].contiguous(),  # stride 4096
        wide[:, :4096].float(),  # another dtype
        wide[:1, :17].contiguous(),  # one chunk, V = 17
    ]
    for _ in range(3):  # first calls compile; later ones launch the compiled handles
        for logits in cases:
            for rows in (1, logits.shape[0]):
                view = logits[:rows]
                got = argmax_module.greedy_argmax(view)
                assert torch.equal(got, view.float().argmax(dim=-1)), (view.shape, view.stride())
    assert len(argmax_module._CHUNKS._compiled) >= len(cases)

    class NoDispatch:  # every case is compiled now: a call must not reach Triton's JIT
        def __getitem__(self, grid):
            raise AssertionError("JIT dispatch after the first call of a specialisation")

    saved = argmax_module._CHUNKS.kernel, argmax_module._ROWS.kernel
    argmax_module._CHUNKS.kernel = argmax_module._ROWS.kernel = NoDispatch()
    try:
        for logits in cases:
            assert torch.equal(argmax_module.greedy_argmax(logits), logits.float().argmax(dim=-1))
    finally:
        argmax_module._CHUNKS.kernel, argmax_module._ROWS.kernel = saved
