"""The GPU attention backend: Triton cache writes plus one unified paged-attention kernel.

    forward(query, key, value, kv_cache, attn_metadata, output)
      1. reshape_and_cache: key/value rows -> kv_cache at slot_mapping (-1 skipped)
      2. unified_attention: every request's new tokens attend causally to
         seq_lens[i] keys through block_table[i]; result written into `output`

    forward_with_rope(positions, rotary_emb, query, key, value, ...)   (what models call)
      1. rope_and_cache: rotate query and key, write rotated key + value into
         kv_cache at slot_mapping: ONE launch instead of rope + reshape_and_cache
      2. unified_attention, as above

Nothing here allocates per step: the split-KV workspace is allocated once per
(device, num_heads, head_size) at the size that covers every split count the
kernel picks on its own, so CUDA graphs captured at any batch size address the
same buffer, and graph replays read only device-side metadata.
"""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch
from torch import nn

from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)
from vllm.v1.attention.ops.attention_config import max_split_workspace_numel
from vllm.v1.attention.ops.attention_warmup import (
    warm_up_prefill_attention,
    warm_up_unified_attention,
)
from vllm.v1.attention.ops.prefill_attention import fresh_prefill_applies, prefill_attention
from vllm.v1.attention.ops.reshape_and_cache import reshape_and_cache
from vllm.v1.attention.ops.rope_and_cache import rope_and_cache
from vllm.v1.attention.ops.unified_attention import unified_attention


class TritonAttentionImpl(AttentionImpl):
    """One layer's attention on CUDA through the Triton kernels."""

    # Split-KV scratch shared by every layer with the same key: layers run one
    # after another on one stream, so no two launches use it at once. Each layer
    # holds its workspace, so it is never replaced while a model (and the CUDA
    # graphs captured with it, which keep its address) lives; the map itself
    # holds it weakly, so it is freed with the last model that uses it (an
    # engine shut down in a process that builds another frees its scratch).
    _workspaces: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()
    _workspace_tensor: torch.Tensor | None = None  # this layer's, once looked up

    def _workspace(self, device: torch.device) -> torch.Tensor:
        workspace = self._workspace_tensor
        if workspace is None:
            key = (device, self.num_heads, self.head_size)
            workspace = self._workspaces.get(key)
            if workspace is None:
                numel = max_split_workspace_numel(self.num_heads, self.head_size)
                workspace = torch.zeros(numel, dtype=torch.float32, device=device)
                self._workspaces[key] = workspace
            self._workspace_tensor = workspace
        return workspace

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    ) -> torch.Tensor:
        """Write key/value into kv_cache at slot_mapping, then attend; returns `output`.

        Raises:
            ValueError: from the kernel launchers, on tensors that do not fit
                (shapes, dtypes, strides, devices; the message has the numbers).
        """
        if query.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(
                f"query must be [num_tokens, {self.num_heads}, {self.head_size}], "
                f"got {tuple(query.shape)}"
            )
        if kv_cache.dim() != 5 or kv_cache.shape[3] != self.num_kv_heads:
            raise ValueError(
                f"kv_cache must be [num_blocks, 2, block_size, {self.num_kv_heads}, "
                f"{self.head_size}], got {tuple(kv_cache.shape)}"
            )
        reshape_and_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        if attn_metadata.no_cached_context and fresh_prefill_applies(
            attn_metadata.max_query_len, query, key, value
        ):
            return self._attend_fresh(query, key, value, attn_metadata, output)
        return self._attend(query, kv_cache, attn_metadata, output)

    def forward_with_rope(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        rotary_emb: nn.Module,  # a RotaryEmbedding (cos_sin_cache, is_neox_style)
        query: torch.Tensor,  # [num_tokens, num_heads * head_size], any row stride
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], any row stride
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], any row stride
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    ) -> torch.Tensor:
        """Rotation + cache write in one launch (`rope_and_cache`), then attention.

        Falls back to the two-step default when the rotary module has no
        `cos_sin_cache` (a rope this kernel does not know).
        """
        cos_sin_cache = getattr(rotary_emb, "cos_sin_cache", None)
        if not isinstance(cos_sin_cache, torch.Tensor):
            return super().forward_with_rope(
                positions, rotary_emb, query, key, value, kv_cache, attn_metadata, output
            )
        num_tokens = query.shape[0]
        key, value = _rows_with_unit_stride(key), _rows_with_unit_stride(value)
        # A fresh prefill reads its keys back contiguously, so the rotated keys are
        # also stored in a tensor of their own (one extra store of each key; the
        # query and that tensor are new and contiguous, hence the two Nones).
        key_out = None
        if attn_metadata.no_cached_context:
            value_rows = value.view(num_tokens, self.num_kv_heads, self.head_size)
            if fresh_prefill_applies(attn_metadata.max_query_len, None, None, value_rows):
                key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        query = rope_and_cache(
            positions,
            _rows_with_unit_stride(query),
            key,
            value,
            cos_sin_cache,
            kv_cache,
            attn_metadata.slot_mapping,
            bool(getattr(rotary_emb, "is_neox_style", True)),
            key_out=key_out,
        )
        if key_out is not None:
            return self._attend_fresh(
                query.view(num_tokens, self.num_heads, self.head_size),
                key_out.view(num_tokens, self.num_kv_heads, self.head_size),
                value_rows,
                attn_metadata,
                output,
            )
        return self._attend(
            query.view(num_tokens, self.num_heads, self.head_size),
            kv_cache,
            attn_metadata,
            output,
        )

    def _attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # this step's keys already written
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return unified_attention(
            query,
            kv_cache,
            output,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            self.scale,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
            workspace=self._workspace(query.device),
        )

    def _attend_fresh(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rotated
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        real = attn_metadata.num_actual_tokens
        if output.shape[0] > real:  # rows past the requests' tokens are padding: zeros
            output[real:].zero_()
        return prefill_attention(
            query, key, value, output, attn_metadata.query_start_loc, self.scale
        )

    def warm_up(
        self, kv_cache: torch.Tensor, max_num_tokens: int, max_model_len: int,
        max_blocks_per_req: int,
    ) -> int:
        """Compile every attention variant a step can select: each unified-attention
        config (see attention_warmup), and `prefill_attention` where fresh prompts
        take it. Returns the number of launches."""
        launches = warm_up_unified_attention(
            kv_cache, self.num_heads, self.scale, self._workspace(kv_cache.device),
            max_num_tokens, max_model_len, max_blocks_per_req,
        )
        return launches + warm_up_prefill_attention(
            kv_cache, self.num_heads, self.scale, max_num_tokens, max_model_len
        )


def _rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x [T, width] with a contiguous last dim (rows may be strided slices of the qkv output)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttentionBackend(AttentionBackend):
    """Paged attention on NVIDIA GPUs (Triton 3.6+)."""

    name = "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl
