"""Qwen2-VL: a ViT with 2D rope and a patch merger in front of Qwen2 with M-RoPE.

    image -> (transformers' Qwen2VLImageProcessor, vllm/multimodal/processing.py)
          -> pixel_values [num_patches, C * T_p * P * P], grid_thw (t, h, w) patches
    visual: patch_embed (a Conv3d with stride = kernel, i.e. one matmul per patch)
          -> depth x Qwen2VLVisionBlock (LayerNorm, full attention within the image,
             2D rope over the patch's (h, w); LayerNorm, quick-GELU MLP)
          -> merger: LayerNorm, each merge x merge block of patches concatenated,
             MLP -> [num_patches / merge^2, hidden]   (one row per <|image_pad|> token)
    language model: Qwen2 (llama.py) whose rope is M-RoPE: the rotary frequencies
          are split into three sections (mrope_section, summing to head_dim / 2)
          rotated by the token's temporal, height and width position.

M-RoPE positions (transformers' `Qwen2VLModel.get_rope_index`): text tokens
count up on all three rows; an image of llm grid (t, h', w') = (t, h/m, w/m)
starting at position s puts its tokens at (s + t_i, s + h_i, s + w_i); the
text after it continues at s + max(h', w') (for an image t' = 1: the image's
largest position + 1). Tokens past the prompt are at position + delta on all
rows, delta = (largest prompt position + 1) - prompt length.

    prompt:   T T <vs> [P P P P P P] <ve> T ...        (2 x 3 llm grid)
    t row:    0 1  2    3 3 3 3 3 3   6   7
    h row:    0 1  2    3 3 3 4 4 4   6   7
    w row:    0 1  2    3 4 5 3 4 5   6   7

The vision tower is replicated on every tensor-parallel rank (it is small
next to the language model); attention inside it is per image (no cross-image
attention), with torch's scaled_dot_product_attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
)
from vllm.model_executor.models.utils import get_head_dim, get_rope_parameters

# ---------------------------------------------------------------- M-RoPE


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (neox style): frequency i rotates by the position of its section.

    Args (besides RotaryEmbedding's):
        mrope_section: [s_t, s_h, s_w], frequencies per section, summing to rotary_dim / 2.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, mrope_section: Sequence[int]) -> None:
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, True)
        if len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must be 3 sections summing "
                             f"to rotary_dim / 2 = {rotary_dim // 2}")
        self.mrope_section = list(mrope_section)
        # Frequency bounds of the t, h, w sections: [0, s_t, s_t + s_h, rotary_dim / 2].
        self.section_bounds = [0, *torch.tensor(self.mrope_section).cumsum(0).tolist()]

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (t, h, w rows) or [T] (all rows equal) int64; query
        [T, num_heads * head_size], key [T, num_kv_heads * head_size] -> rotated copies."""
        if positions.dim() == 1:
            return self.forward_native(positions, query, key)
        num_tokens = positions.shape[1]
        half = self.rotary_dim // 2
        cos_sin = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
        cos3, sin3 = cos_sin[..., :half], cos_sin[..., half:]
        bounds = self.section_bounds
        cos = torch.cat([cos3[j, :, bounds[j]:bounds[j + 1]] for j in range(3)], dim=-1)
        sin = torch.cat([sin3[j, :, bounds[j]:bounds[j + 1]] for j in range(3)], dim=-1)
        cos = cos.to(query.dtype).unsqueeze(1)
        sin = sin.to(query.dtype).unsqueeze(1)
        q = self._rotate(query.reshape(num_tokens, -1, self.head_size), cos, sin)
        k = self._rotate(key.reshape(num_tokens, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)


def mrope_positions(prompt_token_ids: Sequence[int], image_token_id: int,
                    grids: Sequence[tuple[int, int, int]], merge: int
                    ) -> tuple[list[list[int]], int]:
    """The prompt's M-RoPE positions ([3][P]) and the delta for tokens after it.

    Each run of `image_token_id` is one image, in the order of `grids` ((t, h, w)
    patches each). Raises ValueError when runs and grids disagree.
    """
    rows: list[list[int]] = [[], [], []]
    pos, i, n, image = 0, 0, len(prompt_token_ids), 0
    while i < n:
        if prompt_token_ids[i] != image_token_id:
            for row in rows:
                row.append(pos)
            pos, i = pos + 1, i + 1
            continue
        if image >= len(grids):
            raise ValueError("more image placeholder runs than images")
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        for ti in range(t):
            for hi in range(h):
                for wi in range(w):
                    rows[0].append(pos + ti)
                    rows[1].append(pos + hi)
                    rows[2].append(pos + wi)
        i += t * h * w
        pos += max(h, w)
        image += 1
    if image != len(grids) or len(rows[0]) != n:
        raise ValueError(f"{len(grids)} images but {image} placeholder runs of the right length")
    return rows, (max(max(r) for r in rows) + 1 - n) if n else 0


# ---------------------------------------------------------------- vision tower


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_VISION_ACTS = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "silu": F.silu}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen2VLVisionAttention(nn.Module):
    """Full (non-causal) attention within each image: x [N, dim] -> [N, dim]."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """cu_seqlens: patch offsets of the images ([0, n_0, n_0 + n_1, ...]);
        cos/sin [N, head_dim] float32 (the patches' 2D rope)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(x.dtype)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            # [1, heads, len, head_dim] per image: attention never crosses images. 4-D, as
            # torch's fused (flash / memory-efficient) kernels require: with 3-D inputs SDPA
            # falls back to the math path, whose [heads, len, len] scores took 137 GB for
            # the worst-case image (65,536 patches) on an H100 (2026-12-07).
            out[start:end] = F.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))[0].transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str) -> None:
        super().__init__()
        if act not in _VISION_ACTS:
            raise ValueError(f"vision hidden_act {act!r} is not supported; "
                             f"supported: {', '.join(_VISION_ACTS)}")
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen2VLVisionAttention(dim, num_heads)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, mlp_hidden),
                                  "fc2": nn.Linear(mlp_hidden, dim)})
        self.act = _VISION_ACTS[act]

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp["fc2"](self.act(self.mlp["fc1"](self.norm2(x))))


class Qwen2VLPatchMerger(nn.Module):
    """[N, dim] patches (merge x merge blocks consecutive) -> [N / merge^2, out_dim]."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """pixel_values [N, C * T_p * P * P], grids -> image embeddings [N / merge^2, hidden].

    Args:
        vision_config: the HF vision config (embed_dim, depth, num_heads,
            mlp_ratio, patch_size, temporal_patch_size, in_channels,
            spatial_merge_size, hidden_act, hidden_size = the LM's hidden size).
    """

    def __init__(self, vision_config: PretrainedConfig) -> None:
        super().__init__()
        vc = vision_config
        dim, heads = vc.embed_dim, vc.num_heads
        self.merge = vc.spatial_merge_size
        self.patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            vc.in_channels, dim, kernel_size=(vc.temporal_patch_size, vc.patch_size, vc.patch_size),
            stride=(vc.temporal_patch_size, vc.patch_size, vc.patch_size), bias=False)
        head_dim = dim // heads
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32) / spatial), persistent=False)
        self.blocks = nn.ModuleList(
            Qwen2VLVisionBlock(dim, heads, int(dim * vc.mlp_ratio), vc.hidden_act)
            for _ in range(vc.depth))
        self.merger = Qwen2VLPatchMerger(vc.hidden_size, dim, self.merge)

    def rope(self, grids: Sequence[tuple[int, int, int]], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32 for the patches of `grids`, in the processor's
        patch order (merge x merge blocks consecutive, row-major within a block)."""
        m, parts = self.merge, []
        for t, h, w in grids:
            hh = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(-1, -1, w // m, m)
            ww = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, -1, -1)
            hw = torch.stack([hh.transpose(1, 2).flatten(), ww.transpose(1, 2).flatten()], -1)
            parts.append(hw.repeat(t, 1))
        freqs = (torch.cat(parts)[..., None].float() * self.inv_freq).flatten(1)  # [N, hd/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]
                ) -> torch.Tensor:
        weight = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))
        cos, sin = self.rope(grids, x.device)
        cu = [0]
        for t, h, w in grids:
            cu.extend(cu[-1] + h * w for _ in range(t))  # attention within each frame
        for block in self.blocks:
            x = block(x, cu, cos, sin)
        return self.merger(x)


# ---------------------------------------------------------------- language model


class Qwen2VLAttention(Qwen2Attention):
    """Qwen2 attention with M-RoPE: the model rotates q and k (positions [3, T] or [T])."""

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen2VLDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen2VLAttention


class Qwen2VLTextModel(LlamaModel):
    decoder_layer_cls = Qwen2VLDecoderLayer

    def __init__(self, config: PretrainedConfig, **kwargs) -> None:
        super().__init__(config, **kwargs)
        # The layers were given the plain rope; swap in M-RoPE (same cos/sin table).
        head_dim = get_head_dim(config)
        theta, scaling = get_rope_parameters(config)
        section = ((getattr(config, "rope_parameters", None) or {}).get("mrope_section")
                   or (scaling or {}).get("mrope_section"))
        self.rotary_emb = MRotaryEmbedding(head_dim, head_dim, config.max_position_embeddings,
                                           theta, section)
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL over the paged KV cache (vLLM's model interface plus the multimodal one).

    Multimodal interface (the runner's `MultiModalRunner` calls it):
        embed_multimodal(pixel_values, grids) -> [sum(t*h*w/merge^2), hidden] image embeddings
        embed_input_ids(input_ids) -> [T, hidden] token embeddings
        get_mrope_input_positions(prompt_token_ids, grids) -> ([3][P] positions, delta)
        forward(input_ids, positions [3, T] or [T], inputs_embeds=None)
    """

    model_cls = Qwen2VLTextModel
    is_multimodal = True
    uses_mrope = True

    def __init__(self, config: PretrainedConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 prefix: str = "") -> None:
        text_config = config.get_text_config()
        super().__init__(text_config, tp_rank=tp_rank, tp_size=tp_size, prefix=prefix)
        self.hf_config = config
        self.visual = Qwen2VisionTransformer(config.vision_config)
        self.image_token_id = int(config.image_token_id)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] int64, positions [3, T] or [T] int64, inputs_embeds [T, hidden]
        (token embeddings with image rows written in; None = embed input_ids)."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_multimodal(self, pixel_values: torch.Tensor,
                         grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Images' patches [N, patch_dim] (any dtype) -> [N / merge^2, hidden], model dtype."""
        return self.visual(pixel_values, grids)

    def get_mrope_input_positions(self, prompt_token_ids: Sequence[int],
                                  grids: Sequence[tuple[int, int, int]]
                                  ) -> tuple[list[list[int]], int]:
        return mrope_positions(prompt_token_ids, self.image_token_id, grids,
                               self.spatial_merge_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names of either layout: the hub's ("model.layers.*", "visual.*") or
        transformers 5's in memory ("model.language_model.*", "model.visual.*")."""
        return super().load_weights((_hub_name(name), t) for name, t in weights)

    def _skip_weight(self, name: str) -> bool:
        return super()._skip_weight(name) or name.endswith("inv_freq")


def _hub_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name
