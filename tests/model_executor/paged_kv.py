"""Test helper: run a model step by step over a paged KV cache, as the model runner does.

Blocks come from a shuffled free list that never hands out block 0 (the
null block), so block tables are non-trivial and a write through a wrong
slot shows up as a mismatch or as a non-zero null block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from vllm.forward_context import set_forward_context
from vllm.model_executor.models.utils import get_attention_layers
from vllm.v1.attention.backends.abstract import AttentionMetadata


@dataclass
class _Request:
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_padding_tokens: int = 0,
    num_padding_reqs: int = 0,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for requests with `query_lens[i]` new tokens ending at `seq_lens[i]`.

    Padding tokens get slot -1; padding requests get seq_len 0, no query rows
    and an all-zero block-table row.
    """
    num_reqs = len(query_lens) + num_padding_reqs
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_actual = starts[-1]
    starts += [num_actual] * num_padding_reqs
    slots = []
    for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(s - q, s):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    slots += [-1] * num_padding_tokens
    width = max([len(t) for t in block_tables] + [1])
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    seq = torch.tensor(list(seq_lens) + [0] * num_padding_reqs, dtype=torch.int32)
    qsl = torch.tensor(starts, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=num_actual,
        max_query_len=max(query_lens),
        query_start_loc=qsl.to(device),
        max_seq_len=max(seq_lens),
        seq_lens=seq.to(device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )


class PagedKVHarness:
    """Owns per-layer caches [num_blocks, 2, block_size, kv_heads, head_size] and block tables."""

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int = 4,
        num_blocks: int = 128,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.layers = get_attention_layers(model)
        param = next(model.parameters())
        self.device = param.device
        for layer in self.layers.values():
            layer.kv_cache = torch.zeros(
                num_blocks,
                2,
                block_size,
                layer.num_kv_heads,
                layer.head_size,
                dtype=dtype or param.dtype,
                device=self.device,
            )
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free_blocks)
        self.requests: dict[str, _Request] = {}

    def step(
        self,
        batch: list[tuple[str, list[int]]],
        num_padding_tokens: int = 0,
        num_padding_reqs: int = 0,
    ) -> list[torch.Tensor]:
        """Feed each request's new tokens; returns per request the logits [q_i, vocab] fp32."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for req_id, tokens in batch:
            req = self.requests.setdefault(req_id, _Request())
            start, end = req.num_computed, req.num_computed + len(tokens)
            while len(req.blocks) * self.block_size < end:
                req.blocks.append(self.free_blocks.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(req.blocks)
            req.num_computed = end
        ids += [0] * num_padding_tokens
        positions += [0] * num_padding_tokens
        metadata = build_metadata(
            query_lens,
            seq_lens,
            tables,
            self.block_size,
            num_padding_tokens,
            num_padding_reqs,
            self.device,
        )
        with torch.no_grad(), set_forward_context(metadata):
            hidden = self.model(
                torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
            )
            logits = self.model.compute_logits(hidden[: metadata.num_actual_tokens])
        for layer in self.layers.values():
            assert not layer.kv_cache[0].any(), "the null block was written"
        return list(logits.split(query_lens))

    def free(self, req_id: str) -> None:
        self.free_blocks += self.requests.pop(req_id).blocks
