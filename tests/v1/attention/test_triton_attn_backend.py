"""TritonAttentionBackend: launcher validation, split/tile choice, CUDA-graph replay.

The kernels' numerics are in test_triton_kernels.py. Here: what the launchers
reject (checked on the host before any launch, so these run on the CPU), that
the tile and split choice depends on shapes and host bounds only and always
fits the preallocated workspace, and (CUDA) that a graph captured once at upper
bounds stays correct when replayed with other batches.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from tests.v1.attention.test_triton_kernels import TOLERANCE, Case, _batch, metadata

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def _ops():
    from vllm.v1.attention.ops import unified_attention as ua

    return ua


def _cfg():
    from vllm.v1.attention.ops import attention_config

    return attention_config


def _inputs(num_tokens=5, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=None):
    dtype = dtype or torch.float16
    return dict(
        query=torch.zeros(num_tokens, num_heads, head_size, dtype=dtype),
        kv_cache=torch.zeros(3, 2, block_size, num_kv_heads, head_size, dtype=dtype),
        output=torch.zeros(num_tokens, num_heads, head_size, dtype=dtype),
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        seq_lens=torch.tensor([2, 3], dtype=torch.int32),
        block_table=torch.zeros(2, 4, dtype=torch.int32),
    )


def _call(**overrides):
    args = {**_inputs(), **overrides}
    return _ops().unified_attention(**args, scale=1.0, max_query_len=3, max_seq_len=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(query=torch.zeros(5, 4, 32, 1)),
            r"query must be \[num_tokens, num_heads, head_size\]",
        ),
        (
            dict(kv_cache=torch.zeros(3, 2, 16, 2, 64, dtype=torch.float16)),
            r"kv_cache must be \[num_blocks, 2",
        ),
        (
            dict(kv_cache=torch.zeros(3, 2, 16, 3, 32, dtype=torch.float16)),
            r"query heads \(4\) must be a multiple of kv_cache heads \(3\)",
        ),
        (
            dict(kv_cache=torch.zeros(3, 2, 12, 2, 32, dtype=torch.float16)),
            "block_size must be a power of two, got 12",
        ),
        (
            dict(output=torch.zeros(4, 4, 32, dtype=torch.float16)),
            r"output shape \(4, 4, 32\) != query shape \(5, 4, 32\)",
        ),
        (dict(output=torch.zeros(5, 4, 32, dtype=torch.bfloat16)), "output torch.bfloat16"),
        (dict(query=torch.zeros(5, 4, 32, dtype=torch.int8)), "query torch.int8"),
        (
            dict(query=torch.zeros(5, 4, 64, dtype=torch.float16)[..., ::2]),
            "query must have a contiguous last dim",
        ),
        (dict(seq_lens=torch.tensor([2, 3])), r"seq_lens must be contiguous int32 of shape \(2,\)"),
        (
            dict(query_start_loc=torch.tensor([0, 5], dtype=torch.int32)),
            r"query_start_loc must be contiguous int32 of shape \(3,\)",
        ),
        (
            dict(block_table=torch.zeros(1, 4, dtype=torch.int32)),
            r"block_table must be int32 \[>= 2",
        ),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "block_table must be int32"),
    ],
)
def test_unified_attention_rejects_bad_inputs(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter accepts CPU tensors"
)
def test_unified_attention_needs_cuda_tensors():
    with pytest.raises(ValueError, match="needs CUDA tensors .* got device cpu"):
        _call()


def test_config_and_workspace_are_checked():
    from vllm.v1.attention.ops.unified_attention_launch import check_workspace

    cfg = _cfg()
    bad = cfg.AttentionKernelConfig(block_m=8, block_n=64, num_splits=1)
    with pytest.raises(ValueError, match="block_m must be a power of two >= max"):
        _ua_check_config(bad)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        _ua_check_config(cfg.AttentionKernelConfig(block_m=16, block_n=24, num_splits=1))
    with pytest.raises(ValueError, match="workspace has 10 fp32 elements, this launch needs 99"):
        check_workspace(torch.zeros(10), 99, torch.device("cpu"))
    with pytest.raises(ValueError, match="contiguous float32 on cpu"):
        check_workspace(torch.zeros(200, dtype=torch.float16), 99, torch.device("cpu"))


def _ua_check_config(cfg):
    _cfg().check_config(cfg, group_pad=2)


def test_reshape_and_cache_rejects_bad_inputs():
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache

    key = torch.zeros(4, 2, 8)
    cache = torch.zeros(3, 2, 16, 2, 8)
    slots = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"slot_mapping must be int64 \[4\], got torch.int32"):
        reshape_and_cache(key, key, cache, slots.int())
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, 2, block_size, 2, 8\]"):
        reshape_and_cache(key, key, torch.zeros(3, 2, 16, 4, 8), slots)
    with pytest.raises(ValueError, match="value torch.float16"):
        reshape_and_cache(key, key.half(), cache, slots)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 24"):
        reshape_and_cache(key, key, torch.zeros(3, 2, 24, 2, 8), slots)


def test_impl_rejects_mismatched_heads():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    impl = TritonAttentionBackend.get_impl_cls()(4, 32, 1.0, 2)
    x = _inputs()
    with pytest.raises(ValueError, match=r"query must be \[num_tokens, 4, 32\], got \(5, 8, 32\)"):
        impl.forward(torch.zeros(5, 8, 32), None, None, x["kv_cache"], None, None)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, 2, block_size, 2, 32\]"):
        impl.forward(x["query"], None, None, torch.zeros(3, 2, 16, 4, 32), None, None)
    assert TritonAttentionBackend.name == "TRITON_ATTN"


def test_layers_share_a_workspace_that_goes_with_the_last_of_them():
    """One split-KV scratch per (device, heads, head size), held by the layers that use
    it: replaced never while they live, freed with them (it used to live forever in a
    class attribute, across every engine the process built)."""
    import gc

    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    a, b = TritonAttentionImpl(4, 32, 1.0, 2), TritonAttentionImpl(4, 32, 1.0, 2)
    other = TritonAttentionImpl(8, 32, 1.0, 2)
    cpu = torch.device("cpu")
    shared = a._workspace(cpu)
    assert b._workspace(cpu) is shared and a._workspace(cpu) is shared
    assert other._workspace(cpu) is not shared
    key = (cpu, 4, 32)
    del a, shared
    gc.collect()
    assert key in TritonAttentionImpl._workspaces  # b still holds it
    del b
    gc.collect()
    assert key not in TritonAttentionImpl._workspaces


def _select(**kw):
    ua = _cfg()
    args = dict(
        num_tokens=64,
        num_reqs=64,
        num_kv_heads=8,
        queries_per_kv=4,
        head_size=128,
        max_query_len=1,
        max_seq_len=4096,
        dtype=torch.bfloat16,
        sm_count=132,
    )
    return ua.select_config(**{**args, **kw})


def test_select_config_decode_splits_and_prefill_tiles():
    ua = _cfg()
    decode = _select()
    assert (decode.block_m, decode.block_n) == (ua.DECODE_CONFIG.block_m, ua.DECODE_CONFIG.block_n)
    assert decode.decode and decode.num_stages == ua.DECODE_ONE_TOKEN_STAGES
    assert decode.num_splits == 1  # 512 (request, head) pairs already fill 132 SMs
    eight = _select(num_tokens=8, num_reqs=8)
    assert eight.num_splits == 4  # 64 pairs: split until a program per SM (256 >= 132)
    verify = _select(num_tokens=64, num_reqs=16, max_query_len=4)
    assert not verify.decode and verify.num_stages == ua.DECODE_CONFIG.num_stages
    assert verify.num_splits == 8  # 128 (q block, head) pairs: 4 programs per SM = 1024
    small = _select(num_tokens=1, num_reqs=1)
    assert small.num_splits == ua.MAX_SPLITS  # one request: split as far as allowed
    short = _select(num_tokens=1, num_reqs=1, max_seq_len=300)
    assert short.num_splits == 2  # >= MIN_TOKENS_PER_SPLIT keys per split
    prefill = _select(num_tokens=16384, num_reqs=8, max_query_len=2048)
    assert prefill.block_m == ua.PREFILL_CONFIG.block_m and prefill.num_splits == 1
    # Short prompts and short chunks take the small prefill tile; long ones with many keys
    # the large one.
    for q_len, seq_len in ((96, 96), (512, 512), (32, 4096)):
        short = _select(num_tokens=16 * q_len, num_reqs=16, max_query_len=q_len,
                        max_seq_len=seq_len)
        assert (short.block_m, short.block_n) == (ua.SMALL_PREFILL_CONFIG.block_m,
                                                  ua.SMALL_PREFILL_CONFIG.block_n), (q_len, seq_len)
    long = _select(num_tokens=1024, num_reqs=8, max_query_len=128, max_seq_len=2176)
    assert (long.block_m, long.block_n) == (ua.PREFILL_CONFIG.block_m, ua.PREFILL_CONFIG.block_n)
    mqa = _select(num_kv_heads=1, queries_per_kv=32, max_query_len=1)
    assert mqa.block_m == 32  # the whole GQA group in one program
    fp32 = _select(dtype=torch.float32, num_tokens=4096, num_reqs=2, max_query_len=4000)
    assert fp32 == replace(ua.PREFILL_CONFIG_FP32, num_splits=1)


@pytest.mark.parametrize("queries_per_kv", [1, 4, 8])
def test_auto_splits_always_fit_the_preallocated_workspace(queries_per_kv):
    ua = _cfg()
    num_heads, head_size = 8 * queries_per_kv, 96
    for num_tokens in (1, 2, 3, 8, 33, 64, 100, 512, 1024, 8192):
        for num_reqs in {1, min(num_tokens, 7), num_tokens}:
            for max_query_len in {1, -(-num_tokens // num_reqs), num_tokens}:
                cfg = _select(
                    num_tokens=num_tokens,
                    num_reqs=num_reqs,
                    queries_per_kv=queries_per_kv,
                    head_size=head_size,
                    max_query_len=max_query_len,
                    max_seq_len=1 << 17,
                )
                need = ua.split_workspace_numel(cfg.num_splits, num_tokens, num_heads, head_size)
                assert cfg.num_splits == 1 or need <= ua.max_split_workspace_numel(
                    num_heads, head_size
                )


def test_only_decode_launches_of_a_few_splits_reduce_in_their_last_split():
    from vllm.v1.attention.ops.attention_config import (
        DECODE_CONFIG,
        FUSED_REDUCE_MAX_SPLITS,
        ONE_TOKEN_CONFIG,
    )
    from vllm.v1.attention.ops.unified_attention import fuses_reduce

    assert ONE_TOKEN_CONFIG.decode and not DECODE_CONFIG.decode
    assert [n for n in (1, 2, 4, 8, 16, 32) if fuses_reduce(replace(ONE_TOKEN_CONFIG,
            num_splits=n))] == [n for n in (2, 4, 8) if n <= FUSED_REDUCE_MAX_SPLITS]
    assert not fuses_reduce(replace(DECODE_CONFIG, num_splits=2))  # q-block programs


def test_decode_launches_followed_by_the_reduce_kernel_take_one_tile_a_split():
    """A decode launch of more than FUSED_REDUCE_MAX_SPLITS splits (its own reduce
    launch) spreads a short range over one key tile a split; fused-reduce decode
    launches and prefill launches keep MIN_TOKENS_PER_SPLIT keys a split, and an
    explicit split_min_tiles wins."""
    ua = _cfg()
    one_request = _select(num_tokens=1, num_reqs=1, max_seq_len=8192)
    assert one_request.num_splits > ua.FUSED_REDUCE_MAX_SPLITS
    assert one_request.min_tiles_per_split() == 1
    default = ua.MIN_TOKENS_PER_SPLIT // ua.ONE_TOKEN_CONFIG.block_n
    assert default > 1
    fused = _select(num_tokens=1, num_reqs=1, max_seq_len=300)
    assert 1 < fused.num_splits <= ua.FUSED_REDUCE_MAX_SPLITS
    assert fused.min_tiles_per_split() == default
    verify = _select(num_tokens=4, num_reqs=1, max_query_len=4, max_seq_len=8192)
    assert not verify.decode and verify.num_splits > ua.FUSED_REDUCE_MAX_SPLITS
    assert verify.min_tiles_per_split() == ua.MIN_TOKENS_PER_SPLIT // verify.block_n
    assert replace(one_request, split_min_tiles=3).min_tiles_per_split() == 3


# --- CUDA graphs ----------------------------------------------------------------------------
def _replay_cases(prefix: str, num_tokens: int, num_reqs: int, batches):
    cases = []
    for i, reqs in enumerate(batches):
        reqs = tuple(reqs) + ((0, 0),) * (num_reqs - len(reqs))
        pad = num_tokens - sum(q for q, _ in reqs)
        cases.append(Case(f"{prefix}{i}", "bfloat16", 16, 32, 8, 128, reqs, pad_tokens=pad))
    return cases


GRAPH_SETUPS = {
    # name: (num_tokens, num_reqs, max_query_len bound, batches replayed)
    "decode": (
        16,
        16,
        1,
        [
            [
                (1, c)
                for c in (0, 5, 16, 17, 100, 999, 2000, 2047, 3, 64, 65, 1500, 7, 31, 32, 1024)
            ],
            [(1, 700), (1, 1), (1, 2047), (1, 33), (1, 0)],
            [(1, 2047)],
        ],
    ),
    "mixed": (
        64,
        4,
        64,
        [
            [(40, 100), (1, 17), (1, 1999), (1, 0)],
            [(64, 0)],
            [(10, 1500), (1, 7)],
        ],
    ),
}


@pytest.mark.cuda
@pytest.mark.parametrize("setup", list(GRAPH_SETUPS))
def test_cuda_graph_captured_once_replays_other_batches(setup):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache_ref
    from vllm.v1.attention.ops.unified_attention import unified_attention_ref

    num_tokens, num_reqs, max_query_len, batches = GRAPH_SETUPS[setup]
    max_model_len = 2048
    cases = _replay_cases(setup, num_tokens, num_reqs, batches)
    built = [_batch(c, "cuda") for c in cases]
    num_blocks = max(b["kv_cache"].shape[0] for b in built)
    max_blocks = max(b["block_table"].shape[1] for b in built)
    static = {k: torch.zeros_like(v) for k, v in built[0].items() if isinstance(v, torch.Tensor)}
    static["kv_cache"] = torch.zeros(
        num_blocks, *built[0]["kv_cache"].shape[1:], dtype=torch.bfloat16, device="cuda"
    )
    static["block_table"] = torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device="cuda")
    static.update(max_query_len=max_query_len, max_seq_len=max_model_len)  # the capture bounds

    def load(b):
        for name in ("query", "key", "value", "slot_mapping", "query_start_loc", "seq_lens"):
            static[name].copy_(b[name])
        static["kv_cache"].fill_(float("nan"))
        static["kv_cache"][: b["kv_cache"].shape[0]].copy_(b["kv_cache"])
        static["block_table"].zero_()
        static["block_table"][:, : b["block_table"].shape[1]].copy_(b["block_table"])

    impl = TritonAttentionImpl(32, 128, 128**-0.5, 8)
    md = metadata(static)
    output = torch.zeros_like(static["query"])

    def step():
        impl.forward(
            static["query"], static["key"], static["value"], static["kv_cache"], md, output
        )

    load(built[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and allocate the workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for case, b in zip(cases, built, strict=True):
        load(b)
        expected_cache = static["kv_cache"].clone()
        reshape_and_cache_ref(b["key"], b["value"], expected_cache, b["slot_mapping"])
        expected = unified_attention_ref(
            b["query"],
            expected_cache,
            b["query_start_loc"],
            b["seq_lens"],
            static["block_table"],
            128**-0.5,
        )
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        num_real = int(b["query_start_loc"][-1])
        assert torch.isfinite(output).all(), case.name
        assert torch.equal(output[num_real:], torch.zeros_like(output[num_real:])), case.name
        tol = TOLERANCE["bfloat16"]
        assert torch.allclose(output.float(), expected.float(), atol=tol, rtol=tol), case.name
        assert torch.equal(static["kv_cache"].nan_to_num(7.0), expected_cache.nan_to_num(7.0)), (
            case.name
        )
