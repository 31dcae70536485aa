"""The torch attention backend against a naive per-token reference."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model_executor.paged_kv import build_metadata
from vllm.v1.attention.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl
from vllm.v1.attention.selector import get_attn_backend

# (cached context tokens, new query tokens) per request: a prefill, a chunked
# prefill over cached context, decodes, a one-token prompt.
REQUESTS = [(0, 7), (5, 9), (13, 1), (0, 1), (30, 1), (17, 1), (3, 2)]


def naive_attention(q, keys, values, context_len, scale):
    """q [q_len, Hq, D], keys/values [seq_len, Hkv, D] -> [q_len, Hq, D], in float64."""
    q_len, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q_len):
        visible = context_len + j + 1
        for h in range(num_heads):
            k = keys[:visible, h // group].double()
            v = values[:visible, h // group].double()
            weights = torch.softmax(k @ q[j, h].double() * scale, dim=0)
            out[j, h] = weights @ v
    return out


def run_case(block_size, num_heads, num_kv_heads, head_size, dtype, pad_tokens=3, pad_reqs=2):
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads * 10 + num_kv_heads)
    num_blocks = 128
    kv_cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=dtype)
    free = list(range(1, num_blocks))
    random.Random(block_size).shuffle(free)

    tables, seq_lens, query_lens, full_k, full_v = [], [], [], [], []
    for ctx, q_len in REQUESTS:
        seq_len = ctx + q_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        for pos in range(ctx):  # the cached context, written as earlier steps would have
            kv_cache[table[pos // block_size], 0, pos % block_size] = k[pos]
            kv_cache[table[pos // block_size], 1, pos % block_size] = v[pos]
        tables.append(table)
        seq_lens.append(seq_len)
        query_lens.append(q_len)
        full_k.append(k)
        full_v.append(v)
    cache_before = kv_cache.clone()

    num_tokens = sum(query_lens) + pad_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    pad_kv = torch.randn(pad_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    new_k = torch.cat(
        [k[s - q :] for k, s, q in zip(full_k, seq_lens, query_lens, strict=True)] + [pad_kv]
    )
    new_v = torch.cat(
        [v[s - q :] for v, s, q in zip(full_v, seq_lens, query_lens, strict=True)] + [pad_kv]
    )
    metadata = build_metadata(query_lens, seq_lens, tables, block_size, pad_tokens, pad_reqs)
    output = torch.full_like(query, float("nan"))
    scale = head_size**-0.5
    impl = TorchAttentionImpl(num_heads, head_size, scale, num_kv_heads)
    impl.forward(query, new_k, new_v, kv_cache, metadata, output)
    return locals()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(1, 1), (4, 1), (6, 2), (8, 8)])
def test_matches_naive_reference(block_size, num_heads, num_kv_heads):
    head_size = 8 if num_heads > 4 else 24
    c = run_case(block_size, num_heads, num_kv_heads, head_size, torch.float32)
    start = 0
    for i, (ctx, q_len) in enumerate(REQUESTS):
        expected = naive_attention(
            c["query"][start : start + q_len], c["full_k"][i], c["full_v"][i], ctx, c["scale"]
        )
        torch.testing.assert_close(
            c["output"][start : start + q_len].double(), expected, atol=2e-6, rtol=2e-6
        )
        start += q_len
    # Padding rows are zeroed, never left as garbage.
    assert torch.equal(c["output"][start:], torch.zeros_like(c["output"][start:]))


def test_cache_writes_only_the_new_slots():
    c = run_case(4, 4, 2, 8, torch.float32)
    kv_cache, before = c["kv_cache"], c["cache_before"]
    expected = before.clone()
    for i, (ctx, q_len) in enumerate(REQUESTS):
        table = c["tables"][i]
        for pos in range(ctx, ctx + q_len):
            expected[table[pos // 4], 0, pos % 4] = c["full_k"][i][pos]
            expected[table[pos // 4], 1, pos % 4] = c["full_v"][i][pos]
    # Padding tokens (slot -1) wrote nothing: not block 0, not the last block.
    assert torch.equal(kv_cache, expected)
    assert not kv_cache[0].any() and not kv_cache[-1].any()


def test_bf16_close_to_reference():
    c = run_case(16, 6, 2, 8, torch.bfloat16)
    ctx, q_len = REQUESTS[1]
    start = REQUESTS[0][1]
    expected = naive_attention(
        c["query"][start : start + q_len], c["full_k"][1], c["full_v"][1], ctx, c["scale"]
    )
    torch.testing.assert_close(
        c["output"][start : start + q_len].double(), expected, atol=2e-2, rtol=2e-2
    )


def test_query_longer_than_sequence_is_rejected():
    kv_cache = torch.zeros(4, 2, 4, 1, 8)
    metadata = build_metadata([3], [3], [[1]], 4)
    metadata.seq_lens_cpu = torch.tensor([2], dtype=torch.int32)
    impl = TorchAttentionImpl(1, 8, 1.0, 1)
    q = torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="3 query tokens but seq_len 2"):
        impl.forward(q, q, q, kv_cache, metadata, torch.empty_like(q))


def test_selector():
    assert get_attn_backend("cpu") is TorchAttentionBackend
    assert TorchAttentionBackend.get_impl_cls() is TorchAttentionImpl
