"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864).

For a head vector x and position p, each pair of features (x_a, x_b) is
rotated by the angle p * inv_freq[i], inv_freq[i] = base^(-2i / rotary_dim):

    neox style (HF Llama/Qwen):  pairs (i, i + rotary_dim/2)
    gptj style (interleaved):    pairs (2i, 2i + 1)

cos and sin for every position up to `max_position_embeddings` are computed
once in float32 (`cos_sin_cache`, [max_pos, rotary_dim] = cos | sin), looked up
by `positions` and cast to the query dtype before the rotation, as
`transformers` does; the lookup is one gather, so the forward has no host
sync and no data-dependent shape (CUDA-graph safe). Features past
`rotary_dim` (partial rotary) pass through unchanged.

Llama 3 scaling (`rope_type: "llama3"`, Meta's Llama 3.1 release) stretches
the low frequencies by `factor`, keeps the high ones and blends in between;
see `Llama3RotaryEmbedding`.

On CUDA the rotation of query and key runs as one Triton launch
(`ops/rotary.py`), which reads any cache, so the Llama 3 variant shares it;
elsewhere, and as the kernel's reference, the torch code in `forward_native`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.ops import use_fused_ops


class RotaryEmbedding(nn.Module):
    """Plain RoPE.

    Args:
        head_size: features per head.
        rotary_dim: features rotated (<= head_size, even).
        max_position_embeddings: positions covered by the cache; larger
            positions are out of range (an index error on the torch path,
            NaN rotated features from the CUDA kernel, which cannot sync).
        base: rope theta.
        is_neox_style: rotate halves (True, HF Llama/Qwen) or interleaved pairs.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(
                f"rotary_dim ({rotary_dim}) must be even and in (0, head_size={head_size}]"
            )
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        """[rotary_dim / 2] float32 angular frequencies (radians per position)."""
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (self.base**exponent)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq()
        positions = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [max_pos, rotary_dim / 2]
        return torch.cat((angles.cos(), angles.sin()), dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_size]; cos/sin [T, 1, rotary_dim / 2] in x's dtype."""
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = x_rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, num_heads * head_size] and key [T, num_kv_heads * head_size].

        positions: [T] int64 token positions. Returns new tensors, same shapes and dtypes.
        query/key may be strided slices of the qkv projection (row stride > width).
        Runs `forward_cuda` (one Triton launch) for CUDA tensors of
        float16/bfloat16/float32 when Triton imports, else `forward_native`.
        """
        if use_fused_ops(query):
            return self.forward_cuda(positions, query, key)
        return self.forward_native(positions, query, key)

    def forward_cuda(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch for query and key; same contract as `forward_native`.

        A position outside the cache gives NaN features instead of an index
        error (no host sync under a captured graph).
        """
        from vllm.model_executor.layers.ops.rotary import rotary_embedding

        q, k = rotary_embedding(
            positions,
            _rows_with_unit_stride(query),
            _rows_with_unit_stride(key),
            self.cos_sin_cache,
            self.head_size,
            self.is_neox_style,
        )
        return q.view(query.shape), k.view(key.shape)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: the CPU implementation and the kernel's reference."""
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        q = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin)
        k = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )


def _rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x [T, ...] as [T, width] with a contiguous last dim (a view when possible)."""
    rows = x.flatten(1) if x.dim() > 2 else x
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class Llama3RotaryEmbedding(RotaryEmbedding):
    """RoPE with Llama 3.1's frequency-dependent scaling.

    With wavelength w = 2 pi / inv_freq and L = original_max_position_embeddings:
    w < L / high_freq_factor keeps inv_freq; w > L / low_freq_factor divides it
    by `factor`; in between it blends the two with
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor):
    (1 - s) * inv_freq / factor + s * inv_freq.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        *,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position_embeddings: int,
    ) -> None:
        if high_freq_factor <= low_freq_factor:
            raise ValueError(
                f"llama3 rope: high_freq_factor ({high_freq_factor}) must exceed "
                f"low_freq_factor ({low_freq_factor})"
            )
        self.factor = factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        old_len = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(in_between, blended, scaled)


SUPPORTED_ROPE_TYPES = ("default", "llama3")


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """Build the rotary embedding an HF `rope_scaling` / `rope_parameters` dict asks for.

    Args:
        rope_scaling: None or a dict with "rope_type" (or legacy "type"):
            "default", or "llama3" with factor, low_freq_factor,
            high_freq_factor, original_max_position_embeddings.

    Raises:
        ValueError: an unsupported rope type (the message lists the supported
            ones) or a llama3 dict missing a key.
    """
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if key not in rope_scaling]
        if missing:
            raise ValueError(f"llama3 rope_scaling lacks {missing}: {rope_scaling}")
        return Llama3RotaryEmbedding(
            head_size,
            rotary_dim,
            max_position,
            base,
            is_neox_style,
            factor=float(rope_scaling["factor"]),
            low_freq_factor=float(rope_scaling["low_freq_factor"]),
            high_freq_factor=float(rope_scaling["high_freq_factor"]),
            original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
