"""Paged attention in plain torch: the CPU backend (and a readable reference).

One step, for a batch that mixes prefills, chunked prefills and decodes:

  1. write: the new tokens' K/V go to their slots,
        kv_cache[slot // block_size, 0 (K) | 1 (V), slot % block_size] = key | value
     (slot -1 = padding, skipped);
  2. gather: request i's keys 0 .. seq_lens[i]-1 are read through its block table,
        block_table[i, j] -> cache block holding keys j*block_size .. (j+1)*block_size-1
  3. attend: its q_i query rows sit at positions ctx_i .. seq_lens[i]-1
     (ctx_i = seq_lens[i] - q_i cached tokens) and see keys up to their own
     position (causal with an offset), through
     `torch.nn.functional.scaled_dot_product_attention` (GQA via `enable_gqa`).

Decodes (q_i == 1) are batched into one SDPA call over keys padded to the
longest of them and masked by length; requests with more query rows run one
call each. Requests with seq_lens 0 (padding) are skipped, and output rows
past `num_actual_tokens` or past the last request's tokens are zeroed. The
loops read the host copies (`*_cpu`) of the metadata, so this backend costs
host syncs on a GPU: it is meant for the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)


def write_to_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's key/value at its slot (block_id * block_size + offset)."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    block_ids: torch.Tensor,  # [batch, num_blocks_needed] int32/int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `block_ids`'s blocks, in order: each [batch, num_kv_heads, S, head_size].

    S = num_blocks_needed * block_size; positions past a request's length
    hold whatever those blocks hold and must be masked by the caller.
    """
    batch, num_needed = block_ids.shape
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    blocks = kv_cache[block_ids.long()]  # [batch, num_needed, 2, block_size, H, D]
    kv = blocks.transpose(1, 2).reshape(batch, 2, num_needed * block_size, num_kv_heads, head_size)
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


class TorchAttentionImpl(AttentionImpl):
    """`AttentionImpl` over torch ops: any device, meant for the CPU."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    ) -> torch.Tensor:
        num_actual = attn_metadata.num_actual_tokens
        write_to_kv_cache(
            key[:num_actual], value[:num_actual], kv_cache, attn_metadata.slot_mapping[:num_actual]
        )
        starts = attn_metadata.query_start_loc_cpu.tolist()
        output[min(num_actual, starts[-1]):].zero_()  # padding rows (padded graph steps too)
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        decodes: list[int] = []
        for i, seq_len in enumerate(seq_lens):
            query_len = starts[i + 1] - starts[i]
            if query_len > seq_len:
                raise ValueError(
                    f"request {i}: {query_len} query tokens but seq_len {seq_len} "
                    "(seq_len counts cached and new tokens)"
                )
            if query_len == 1:
                decodes.append(i)
            elif query_len > 1:
                self._attend_request(query, kv_cache, attn_metadata, output, i, starts, seq_len)
        if decodes:
            self._attend_decodes(query, kv_cache, attn_metadata, output, decodes, starts, seq_lens)
        return output

    def _attend_request(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,
        i: int,
        starts: list[int],
        seq_len: int,
    ) -> None:
        """Request i's q rows against its seq_len keys, causal from offset seq_len - q."""
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        block_size = kv_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        k, v = gather_kv(kv_cache, attn_metadata.block_table[i : i + 1, :num_blocks])
        k, v = k[:, :, :seq_len], v[:, :, :seq_len]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q, D]
        context_len = seq_len - query_len
        if context_len == 0:
            mask, is_causal = None, True
        else:
            # Query row j sits at position context_len + j and sees keys 0 .. that position.
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(context_len, seq_len, device=query.device)
            mask, is_causal = key_pos[None, :] <= query_pos[:, None], False
        out = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        output[start:end] = out[0].transpose(0, 1)

    def _attend_decodes(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,
        decodes: list[int],
        starts: list[int],
        seq_lens: list[int],
    ) -> None:
        """All one-token requests in one SDPA call, keys padded to the longest and masked."""
        device = query.device
        block_size = kv_cache.shape[2]
        lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
        max_len = max(seq_lens[i] for i in decodes)
        num_blocks = -(-max_len // block_size)
        req_ids = torch.tensor(decodes, device=device)
        k, v = gather_kv(kv_cache, attn_metadata.block_table[req_ids, :num_blocks])
        k, v = k[:, :, :max_len], v[:, :, :max_len]
        rows = torch.tensor([starts[i] for i in decodes], device=device)
        q = query[rows].unsqueeze(2)  # [B, num_heads, 1, D]
        mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        output[rows] = out[:, :, 0]


class TorchAttentionBackend(AttentionBackend):
    name = "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl
