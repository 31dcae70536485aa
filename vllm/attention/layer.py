"""The attention layer models use; the backend and the KV cache plug in below it."""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.abstract import AttentionImpl


class Attention(nn.Module):
    """Paged attention for one decoder layer.

    Args:
        num_heads: query heads on this rank.
        head_size: elements per head.
        scale: softmax scale (usually head_size ** -0.5).
        num_kv_heads: key/value heads on this rank (GQA when < num_heads).
        prefix: the layer's unique name, e.g. "model.layers.0.self_attn.attn";
            it keys the layer's KV cache spec and its view of the cache.

    The runner binds `kv_cache` (a view [num_blocks, 2, block_size,
    num_kv_heads, head_size] over the committed part of the backing
    allocation) with `bind_kv_cache`; the backend follows the device of the
    inputs (Triton on CUDA, the torch reference elsewhere).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None
        self._impls: dict[str, AttentionImpl] = {}

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        return FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=dtype,
        )

    def _impl(self, device_type: str) -> AttentionImpl:
        impl = self._impls.get(device_type)
        if impl is None:
            from vllm.v1.attention.selector import get_attn_backend

            impl_cls = get_attn_backend(device_type).get_impl_cls()
            impl = impl_cls(self.num_heads, self.head_size, self.scale, self.num_kv_heads)
            self._impls[device_type] = impl
        return impl

    def warm_up_kernels(self, max_num_tokens: int, max_model_len: int,
                        max_blocks_per_req: int) -> int:
        """Compile this layer's attention kernels for every step it can see (needs the cache)."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: warm_up_kernels needs the bound KV cache")
        return self._impl(self.kv_cache.device.type).warm_up(
            self.kv_cache, max_num_tokens, max_model_len, max_blocks_per_req
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: nn.Module | None = None,
    ) -> torch.Tensor:
        """Attend over the paged cache, rotating query and key first if given a rope.

        query [T, num_heads * head_size], key / value [T, num_kv_heads * head_size]
        (row strides free: slices of the qkv projection) -> [T, num_heads * head_size].
        With `rotary_emb` (a `RotaryEmbedding`) and `positions` ([T] int64), query
        and key are rotated before the cache write; the Triton backend does the
        rotation and the write in one launch (`rope_and_cache`).
        """
        if (rotary_emb is None) != (positions is None):
            raise ValueError("Attention.forward: pass both positions and rotary_emb, or neither")
        num_tokens = query.shape[0]
        output = torch.empty(
            num_tokens, self.num_heads * self.head_size, dtype=query.dtype, device=query.device
        )
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None or self.kv_cache is None:
            # Memory-profiling run before the KV cache exists: the kernels
            # allocate nothing beyond `output` (and the rope's outputs, made
            # here so the profiled peak sees them), so skipping them keeps
            # the profiled peak honest.
            if rotary_emb is not None:
                rotary_emb(positions, query, key)
            return output.zero_()
        impl = self._impl(query.device.type)
        out3 = output.view(num_tokens, self.num_heads, self.head_size)
        if rotary_emb is not None:
            impl.forward_with_rope(
                positions, rotary_emb, query, key, value, self.kv_cache, attn_metadata, out3
            )
            return output
        impl.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            attn_metadata,
            out3,
        )
        return output
