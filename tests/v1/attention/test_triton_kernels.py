"""The Triton kernels against their plain-torch references.

Two ways to run the same checks:

* CPU (CI): the Triton interpreter. TRITON_INTERPRET=1 must be set before the
  kernels are decorated, which a pytest process that may already have imported
  them cannot promise, so the interpreted cases run in ONE subprocess started
  with the variable set (tests/triton_interpreter.py). It imports this module,
  runs `_run_interpreted_cases` and prints one JSON line; each parametrised
  test checks its own entry. The 3.9 interpreter's bf16 `tl.dot` is wrong, so
  interpreted cases use fp32/fp16.
* CUDA (marker `cuda`): the full sweep in fp32/bf16/fp16 in this process, plus
  a CUDA-graph test (capture once at upper bounds, replay other batches).

Every case fills the cache with NaN except the slots that hold real tokens and
the output with NaN before the launch: a stray read of an unwritten slot or a
row the kernel forgets to write shows up as NaN.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from tests.triton_interpreter import check_result, needs_triton, run_checks, run_interpreted


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str  # torch dtype name
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    reqs: tuple[tuple[int, int], ...]  # (q_len, context_len); (0, 0) is a padded request
    pad_tokens: int = 0  # query rows after the last request's tokens
    block_m: int = 0  # 0 = the launcher's choice
    block_n: int = 0
    num_splits: int = 0
    split_min_tiles: int = 0  # 0 = from MIN_TOKENS_PER_SPLIT (explicit configs only)
    # Host bounds passed to the launcher (0 = the batch's own maxima). Larger values
    # mimic a CUDA graph captured at upper bounds and replayed with this batch.
    bound_query_len: int = 0
    bound_seq_len: int = 0


TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}


def _generator(name: str, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))


def _batch(case: Case, device: str):
    """Random query/key/value, a NaN-filled cache holding the context, block tables, slots."""
    dtype, gen = getattr(torch, case.dtype), _generator(case.name, device)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    q_lens = [q for q, _ in case.reqs]
    seq_lens = [q + c for q, c in case.reqs]
    num_tokens = sum(q_lens) + case.pad_tokens
    max_blocks = max(-(-s // bs) for s in seq_lens) + 2  # spare entries point at block 0
    num_blocks = 1 + sum(-(-s // bs) for s in seq_lens) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).tolist()
    block_table = torch.zeros(len(case.reqs), max_blocks, dtype=torch.int32, device=device)
    kv_cache = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), dtype=dtype, device=device)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    start = 0
    for i, ((q_len, ctx), seq_len) in enumerate(zip(case.reqs, seq_lens, strict=True)):
        n = -(-seq_len // bs)
        block_table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        pos = torch.arange(seq_len, device=device)
        slots = block_table[i, pos // bs].long() * bs + pos % bs
        ctx_kv = torch.randn(2, ctx, hkv, d, generator=gen, device=device).to(dtype)
        blocks, offs = slots[:ctx] // bs, slots[:ctx] % bs
        kv_cache[blocks, 0, offs], kv_cache[blocks, 1, offs] = ctx_kv[0], ctx_kv[1]
        slot_mapping[start : start + q_len] = slots[ctx:]
        start += q_len
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        query=torch.randn(num_tokens, case.num_heads, d, generator=gen, device=device).to(dtype),
        key=torch.randn(num_tokens, hkv, d, generator=gen, device=device).to(dtype),
        value=torch.randn(num_tokens, hkv, d, generator=gen, device=device).to(dtype),
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        max_query_len=case.bound_query_len or max(q_lens),
        max_seq_len=case.bound_seq_len or max(seq_lens),
    )


def check_attention(case: Case, device: str) -> None:
    """reshape_and_cache + unified_attention vs the references; raises AssertionError."""
    from vllm.v1.attention.ops.attention_config import (
        DECODE_CONFIG,
        MAX_SPLITS,
        AttentionKernelConfig,
        head_pad,
        split_counters_numel,
    )
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
    from vllm.v1.attention.ops.unified_attention import unified_attention, unified_attention_ref

    b = _batch(case, device)
    scale = case.head_size**-0.5
    ref_cache = b["kv_cache"].clone()
    reshape_and_cache_ref(b["key"], b["value"], ref_cache, b["slot_mapping"])
    reshape_and_cache(b["key"], b["value"], b["kv_cache"], b["slot_mapping"])
    assert torch.equal(b["kv_cache"].nan_to_num(7.0), ref_cache.nan_to_num(7.0)), (
        "cache writes differ"
    )

    config = None
    if case.block_m or case.block_n or case.num_splits or case.split_min_tiles:
        config = AttentionKernelConfig(
            block_m=case.block_m or DECODE_CONFIG.block_m,
            block_n=case.block_n or DECODE_CONFIG.block_n,
            num_splits=case.num_splits,
            decode=b["max_query_len"] <= 1,  # as select_config decides
            split_min_tiles=case.split_min_tiles,
        )
    output = torch.full_like(b["query"], float("nan"))
    args = (
        b["query"],
        b["kv_cache"],
        output,
        b["query_start_loc"],
        b["seq_lens"],
        b["block_table"],
    )
    # One workspace for two launches: a split decode launch leaves the arrival counters
    # at the workspace's front at zero for the next one (CUDA graphs replay on one
    # workspace), and the second launch's output equals the first's. The partials
    # start as NaN: a reduce that read a split nobody wrote would show it.
    counters = split_counters_numel(case.num_heads)
    rows = MAX_SPLITS * b["query"].shape[0] * case.num_heads
    workspace = torch.full((counters + rows * (head_pad(case.head_size) + 2),), float("nan"),
                           dtype=torch.float32, device=device)
    workspace[:counters] = 0
    bounds = (scale, b["max_query_len"], b["max_seq_len"])
    unified_attention(*args, *bounds, workspace=workspace, config=config)
    first = output.clone()
    output.fill_(float("nan"))
    unified_attention(*args, *bounds, workspace=workspace, config=config)
    assert torch.equal(output.nan_to_num(7.0), first.nan_to_num(7.0)), "second launch differs"
    assert not workspace[:counters].view(torch.int32).any(), "split counters not reset to 0"
    expected = unified_attention_ref(
        b["query"], ref_cache, b["query_start_loc"], b["seq_lens"], b["block_table"], scale
    )
    num_real = int(b["query_start_loc"][-1])
    assert torch.isfinite(output).all(), "NaN/inf in the output"
    assert torch.equal(output[num_real:], torch.zeros_like(output[num_real:])), "padding rows not 0"
    tol = TOLERANCE[case.dtype]
    err = (output.float() - expected.float()).abs().max().item()
    assert torch.allclose(output.float(), expected.float(), atol=tol, rtol=tol), f"max error {err}"


def check_reshape_and_cache(case: Case, device: str) -> None:
    """Slots -1 write nothing; every other slot gets its row."""
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    dtype, gen = getattr(torch, case.dtype), _generator(case.name, device)
    num_tokens = sum(q for q, _ in case.reqs)
    # Room for every token plus a spare block, so some slots stay untouched.
    num_blocks = max(7, -(-num_tokens // case.block_size) + 1)
    num_slots = num_blocks * case.block_size
    shape = (num_tokens, case.num_kv_heads, case.head_size)
    key = torch.randn(shape, generator=gen, device=device).to(dtype)
    value = torch.randn(shape, generator=gen, device=device).to(dtype)
    slots = torch.randperm(num_slots, generator=gen, device=device)[:num_tokens]
    slots[::4] = -1
    cache = torch.randn(num_blocks, 2, case.block_size, *shape[1:], generator=gen, device=device)
    cache = cache.to(dtype)
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
    keep = slots >= 0
    blocks, offs = slots[keep] // case.block_size, slots[keep] % case.block_size
    assert torch.equal(cache[blocks, 0, offs], key[keep])
    assert torch.equal(cache[blocks, 1, offs], value[keep])
    assert int(keep.sum()) < num_tokens  # the skipped slots were exercised


# Small on purpose: the interpreter runs every program in Python.
INTERPRETED_ATTENTION = [
    Case(
        "mixed_gqa3_d40", "float32", 16, 6, 2, 40, ((7, 0), (5, 19), (1, 40), (0, 0)), pad_tokens=3
    ),
    Case(
        "mixed_gqa3_split3_n16",
        "float32",
        16,
        6,
        2,
        40,
        ((7, 0), (5, 19), (1, 40), (0, 0)),
        pad_tokens=3,
        block_m=16,
        block_n=16,
        num_splits=3,
    ),
    Case(
        "prefill_mqa8_bs32_d64",
        "float16",
        32,
        8,
        1,
        64,
        ((37, 0), (1, 70), (20, 45)),
        block_m=128,
        block_n=64,
    ),
    Case(
        "decode_mha_bs16_d32",
        "float32",
        16,
        3,
        3,
        32,
        ((1, 0), (1, 16), (1, 33), (1, 100), (0, 0), (0, 0)),
        pad_tokens=2,
    ),
    Case(
        "spec_g2_d80_split2",
        "float16",
        16,
        4,
        2,
        80,
        ((3, 29), (4, 0), (2, 15)),
        block_n=64,
        num_splits=2,
    ),
    Case("one_head_bs32_split4", "float32", 32, 1, 1, 16, ((13, 50),), num_splits=4),
    # Long causal ranges in small tiles: most tiles take the unmasked loop, the
    # ones crossing a row's limit the masked one (the NaN-filled cache catches a
    # read past the keys); head_size = its padding, then not.
    Case(
        "prefill_unmasked_tiles_d32", "float16", 16, 4, 2, 32, ((40, 50), (1, 70), (33, 0)),
        pad_tokens=2, block_m=16, block_n=16,
    ),
    Case(
        "prefill_unmasked_split2_d40", "float32", 8, 6, 2, 40, ((17, 37), (1, 52)),
        block_m=16, block_n=16, num_splits=2,
    ),
    # More splits than FUSED_REDUCE_MAX_SPLITS: the decode launch is followed by the
    # reduce kernel (fewer reduce in the attention kernel's last split).
    Case(
        "decode_split16_reduce_launch", "float32", 16, 4, 2, 16, ((1, 90), (1, 7), (0, 0)),
        pad_tokens=1, block_n=16, num_splits=16, split_min_tiles=1,
    ),
    # Decode (one request per program, no search) over 4 splits of >= 8 tiles of 16
    # keys: the 201-key request uses two splits, the short ones one, the rest idle.
    Case(
        "decode_split4_idle_splits", "float32", 16, 8, 2, 64,
        ((1, 5), (1, 200), (1, 63), (1, 64), (0, 0)), pad_tokens=3, block_n=16, num_splits=4,
    ),
    # Every split may hold a single tile: a one-key request, and padding rows past
    # the requests' tokens whose programs serve no request.
    Case(
        "decode_split8_one_tile_splits", "float16", 16, 6, 3, 40, ((1, 100), (1, 0), (1, 17)),
        pad_tokens=4, block_n=16, num_splits=8, split_min_tiles=1,
    ),
    # Prefill q blocks with a minimum split length: causal ranges of different q
    # blocks of one request run on different numbers of splits.
    Case(
        "mixed_split4_min2_tiles", "float32", 16, 4, 2, 32, ((23, 60), (3, 0), (1, 90)),
        block_m=16, block_n=16, num_splits=4, split_min_tiles=2,
    ),
    # As replayed under a graph captured at max_query_len 1 / max_seq_len 4096.
    Case(
        "decode_bounds_padded",
        "float32",
        16,
        4,
        2,
        32,
        ((1, 40), (1, 3), (0, 0), (0, 0)),
        pad_tokens=2,
        bound_query_len=1,
        bound_seq_len=4096,
    ),
    # As replayed under a graph captured at max_query_len 64 / max_seq_len 2048.
    Case(
        "mixed_bounds_padded",
        "float16",
        16,
        4,
        2,
        32,
        ((9, 20), (1, 5), (0, 0)),
        pad_tokens=5,
        bound_query_len=64,
        bound_seq_len=2048,
    ),
]
INTERPRETED_CACHE = [
    Case("cache_bs16_h2_d40", "float32", 16, 2, 2, 40, ((11, 0),)),
    Case("cache_bs32_h5_d64", "float16", 32, 5, 5, 64, ((9, 0),)),
]


def check_backend(case: Case, device: str) -> None:
    """TritonAttentionImpl.forward (cache write + attention) vs the references."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache_ref
    from vllm.v1.attention.ops.unified_attention import unified_attention_ref

    b = _batch(case, device)
    scale = case.head_size**-0.5
    impl_cls = TritonAttentionBackend.get_impl_cls()
    impl = impl_cls(case.num_heads, case.head_size, scale, case.num_kv_heads)
    ref_cache = b["kv_cache"].clone()
    reshape_and_cache_ref(b["key"], b["value"], ref_cache, b["slot_mapping"])
    expected = unified_attention_ref(
        b["query"], ref_cache, b["query_start_loc"], b["seq_lens"], b["block_table"], scale
    )
    output = torch.full_like(b["query"], float("nan"))
    returned = impl.forward(b["query"], b["key"], b["value"], b["kv_cache"], metadata(b), output)
    assert returned is output
    assert torch.equal(b["kv_cache"].nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    tol = TOLERANCE[case.dtype]
    assert torch.allclose(output.float(), expected.float(), atol=tol, rtol=tol)


def metadata(b: dict):
    """AttentionMetadata over a batch built by `_batch`."""
    from vllm.v1.attention.backends.abstract import AttentionMetadata

    return AttentionMetadata(
        num_actual_tokens=int(b["query_start_loc"][-1]),
        max_query_len=b["max_query_len"],
        query_start_loc=b["query_start_loc"],
        max_seq_len=b["max_seq_len"],
        seq_lens=b["seq_lens"],
        block_table=b["block_table"],
        slot_mapping=b["slot_mapping"],
        query_start_loc_cpu=b["query_start_loc"].cpu(),
        seq_lens_cpu=b["seq_lens"].cpu(),
    )


INTERPRETED_BACKEND = [
    Case(
        "backend_gqa4_bs16_d64", "float32", 16, 8, 2, 64, ((5, 11), (1, 30), (0, 0)), pad_tokens=2
    ),
]


def _run_interpreted_cases() -> dict[str, str]:
    """Run every interpreted case on the CPU; name -> "ok" or the traceback (or a skip
    reason when this Triton's interpreter cannot loop over runtime bounds)."""
    return run_checks(
        (
            (check_attention, INTERPRETED_ATTENTION),
            (check_reshape_and_cache, INTERPRETED_CACHE),
            (check_backend, INTERPRETED_BACKEND),
        ),
        probe=True,
    )


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.v1.attention.test_triton_kernels", timeout_s=600)


@needs_triton
@pytest.mark.parametrize(
    "name", [c.name for c in INTERPRETED_ATTENTION + INTERPRETED_CACHE + INTERPRETED_BACKEND]
)
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


# --- CUDA: the full sweep -------------------------------------------------------------------
_HEADS = [
    (4, 2, 16),
    (1, 1, 64),
    (4, 1, 128),
    (8, 2, 128),
    (6, 3, 80),
    (8, 8, 64),
    (32, 8, 128),
    (7, 7, 96),
    (16, 2, 32),
]
_MIXED = ((17, 0), (1, 37), (9, 100), (1, 1), (0, 0), (30, 5), (1, 250))
_DECODE = ((1, 0), (1, 15), (1, 16), (1, 333), (1, 1000), (0, 0))


def _cuda_cases() -> list[Case]:
    cases = []
    for dtype in ("float32", "bfloat16", "float16"):
        for bs in (16, 32):
            for hq, hkv, d in _HEADS:
                tag = f"{dtype}_bs{bs}_h{hq}x{hkv}_d{d}"
                cases.append(Case(f"mixed_{tag}", dtype, bs, hq, hkv, d, _MIXED, pad_tokens=5))
                if dtype == "bfloat16" or hq == 32:
                    cases.append(
                        Case(f"decode_{tag}", dtype, bs, hq, hkv, d, _DECODE, pad_tokens=3)
                    )
    for splits in (1, 2, 5):
        for block_n in (16, 128):
            for hq, hkv, d in ((32, 8, 128), (6, 3, 80)):
                name = f"forced_s{splits}_n{block_n}_h{hq}x{hkv}_d{d}"
                cases.append(
                    Case(
                        name,
                        "bfloat16",
                        16,
                        hq,
                        hkv,
                        d,
                        _MIXED,
                        pad_tokens=2,
                        block_m=16 if hq // hkv <= 4 else 32,
                        block_n=block_n,
                        num_splits=splits,
                    )
                )
    cases.append(
        Case("prefill_long_bf16", "bfloat16", 16, 32, 8, 128, ((1000, 0), (513, 700), (1, 4000)))
    )
    return cases


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("case", _cuda_cases(), ids=lambda c: c.name)
def test_attention_cuda(case: Case) -> None:
    check_attention(case, "cuda")


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize(
    "case",
    INTERPRETED_CACHE
    + [
        Case("cache_bf16_bs16_h8_d128", "bfloat16", 16, 8, 8, 128, ((300, 0),)),
        Case("cache_fp16_bs32_h64_d128", "float16", 32, 64, 64, 128, ((57, 0),)),
    ],
    ids=lambda c: c.name,
)
def test_reshape_and_cache_cuda(case: Case) -> None:
    check_reshape_and_cache(case, "cuda")
