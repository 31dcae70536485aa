"""Compile every unified-attention variant a request can select, before serving.

Triton compiles a kernel the first time it is launched with a new
specialisation: new constexprs (tiles, split count), launch options, dtypes,
or a new class of an integer argument (value 1, multiple of 16) or pointer
alignment. The per-step integers (num_tokens, num_reqs) are excluded from
specialisation in the kernels; what is left varies only with the tiles and
split count `select_config` picks, and `reachable_configs` lists all of them.
`warm_up_unified_attention` launches each once on a dummy batch whose tensors
have the real ones' dtypes and stride classes (contiguous query and output as
the model passes them; the engine's own KV cache and workspace), so serving
never compiles (issue 10 measured 0.5-1.2 s of TTFT for each new class).

Rejected: compiling lazily but ahead of a request's first step (the request
would still wait), and `JITFunction.warmup` with mock tensors (its argument
classes would have to mirror the launcher's by hand, and drift).
"""

from __future__ import annotations

import torch

from vllm.v1.attention.ops.attention_config import (
    FRESH_PREFILL_MIN_QUERY_LEN,
    num_sms,
    reachable_configs,
)
from vllm.v1.attention.ops.prefill_attention import fresh_prefill_applies, prefill_attention
from vllm.v1.attention.ops.unified_attention import unified_attention


def warm_up_unified_attention(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    num_heads: int,
    scale: float,
    workspace: torch.Tensor,  # fp32, >= max_split_workspace_numel(num_heads, head_size)
    max_num_tokens: int,
    max_model_len: int,
    max_blocks_per_req: int,
) -> int:
    """Launch `unified_attention` once per reachable config; returns how many.

    The dummy batch is one request of the config's query length whose keys
    all come from block 0 (the null block); only `output` (a scratch tensor)
    and `workspace` are written, the cache is only read.

    Args:
        kv_cache: one layer's cache view (its strides are the served ones).
        num_heads: query heads (a multiple of the cache's KV heads).
        max_num_tokens, max_model_len: the engine's bounds (tokens a step,
            keys a request).
        max_blocks_per_req: width of the engine's block table (its row stride).
    """
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    device, dtype = kv_cache.device, kv_cache.dtype
    configs = reachable_configs(
        num_kv_heads=num_kv_heads, queries_per_kv=num_heads // num_kv_heads,
        head_size=head_size, dtype=dtype, sm_count=num_sms(device),
        max_num_tokens=max_num_tokens, max_model_len=max_model_len,
    )
    block_table = torch.zeros((1, max_blocks_per_req), dtype=torch.int32, device=device)
    for query_len, cfg in configs:
        query = torch.zeros((query_len, num_heads, head_size), dtype=dtype, device=device)
        unified_attention(
            query, kv_cache, torch.empty_like(query),
            torch.tensor([0, query_len], dtype=torch.int32, device=device),
            torch.tensor([query_len], dtype=torch.int32, device=device),
            block_table, scale, query_len, max_model_len, workspace=workspace, config=cfg,
        )
    return len(configs)


def warm_up_prefill_attention(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    num_heads: int,
    scale: float,
    max_num_tokens: int,
    max_model_len: int,
) -> int:
    """Launch `prefill_attention` once if fresh prompts can take it; returns 0 or 1.

    It has one tile config and does not specialise on the token or request
    count; its descriptors carry shapes and strides as run-time values, so one
    launch on a dummy prompt of FRESH_PREFILL_MIN_QUERY_LEN tokens (value rows
    strided as in the qkv projection) compiles the variant every step uses.
    """
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    n = FRESH_PREFILL_MIN_QUERY_LEN
    if min(max_num_tokens, max_model_len) < n:
        return 0
    device, dtype = kv_cache.device, kv_cache.dtype
    kv_width = num_kv_heads * head_size
    qkv = torch.zeros((n, num_heads * head_size + 2 * kv_width), dtype=dtype, device=device)
    value = qkv[:, -kv_width:].view(n, num_kv_heads, head_size)
    if not fresh_prefill_applies(n, None, None, value):
        return 0
    query = torch.zeros((n, num_heads, head_size), dtype=dtype, device=device)
    key = torch.zeros((n, num_kv_heads, head_size), dtype=dtype, device=device)
    prefill_attention(query, key, value, torch.empty_like(query),
                      torch.tensor([0, n], dtype=torch.int32, device=device), scale)
    return 1
