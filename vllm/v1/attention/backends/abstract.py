"""The attention backend interface: metadata for one step and the kernel entry.

A batch mixes prefills (many new tokens, possibly after cached context) and
decodes (one new token); there are no modes. Tokens of all requests are
flattened into one dimension:

    query rows:   | req0: q0 tokens | req1: q1 tokens | ... | padding |
    query_start_loc = [0, q0, q0+q1, ...]            (num_reqs + 1 entries)
    seq_lens[i]     = cached context of req i + q_i  (keys it attends to)
    token j of req i sits at position seq_lens[i] - q_i + j and attends causally
    to keys 0 .. that position, read through block_table[i].
    slot_mapping[t] = block_id * block_size + offset where token t's K/V is written;
                      -1 marks padding tokens, which write nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # real tokens this step; query rows past it are padding
    max_query_len: int  # upper bound of the q_i (under a CUDA graph: the captured bound)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    max_seq_len: int  # upper bound of seq_lens (under a CUDA graph: max_model_len)
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device; 0 for padded requests
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [num_tokens] int64, on the device; -1 = padding
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32 host copy
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32 host copy
    # Every request starts at position 0 this step (seq_lens == query lengths: fresh
    # prompts, no prefix-cache hit, no earlier chunk), so all keys it attends to are
    # this step's own key/value rows; a backend may read them there.
    no_cached_context: bool = False

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionImpl(ABC):
    """One layer's attention computation over the paged KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    ) -> torch.Tensor:
        """Write key/value into kv_cache at slot_mapping, then attend; returns `output`."""

    def forward_with_rope(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        rotary_emb: nn.Module,  # a RotaryEmbedding: (positions, q, k) -> (q, k)
        query: torch.Tensor,  # [num_tokens, num_heads * head_size], any row stride
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], any row stride
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], any row stride
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    ) -> torch.Tensor:
        """Rotate query and key by `positions`, then `forward`; returns `output`.

        The default runs the rotation and `forward` one after the other;
        backends with a fused rotation + cache-write kernel override it
        (Triton: one launch fewer per layer).
        """
        num_tokens = query.shape[0]
        query, key = rotary_emb(positions, query, key)
        return self.forward(
            query.reshape(num_tokens, self.num_heads, self.head_size),
            key.reshape(num_tokens, self.num_kv_heads, self.head_size),
            value.reshape(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
            output,
        )

    def warm_up(
        self, kv_cache: torch.Tensor, max_num_tokens: int, max_model_len: int,
        max_blocks_per_req: int,
    ) -> int:
        """Compile every kernel variant a step can launch (start-up); returns how many ran.

        Backends whose kernels compile per shape class (Triton) override this so
        that no request waits for a compilation; the default compiles nothing.
        """
        return 0


class AttentionBackend(ABC):
    name: str

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

