"""Weights from a GGUF file (llama.cpp's format), read with the `gguf` package.

    GGUF tensor                  HF name
    token_embd.weight            model.embed_tokens.weight
    blk.N.attn_norm.weight       model.layers.N.input_layernorm.weight
    blk.N.attn_q|k|v.{w,b}       model.layers.N.self_attn.q_proj|k_proj|v_proj.{w,b}
    blk.N.attn_q_norm|k_norm     model.layers.N.self_attn.q_norm|k_norm.weight   (Qwen3)
    blk.N.attn_output.weight     model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight        model.layers.N.post_attention_layernorm.weight
    blk.N.ffn_gate|up|down       model.layers.N.mlp.gate_proj|up_proj|down_proj.weight
    output_norm.weight           model.norm.weight
    output.weight                lm_head.weight   (absent when embeddings are tied)

Tensor types: F32, F16 and BF16 are reinterpreted in place (zero copy from
the memory map); Q8_0, Q4_0 and Q4_1 are dequantized to float32 by
`gguf.quants.dequantize`. Any other type is refused, naming tensor and type.

llama.cpp's converter permutes the rows of attn_q / attn_k of the `llama`
architecture so that rope pairs features (2i, 2i+1) (GPT-J style); the HF
model pairs (i, i + d/2). Per head of d rows:

    HF row order:   [r0 .. r(d/2-1) | r(d/2) .. r(d-1)]
    GGUF row order: [r0, r(d/2), r1, r(d/2+1), ...]

so the loader reshapes to [heads, d/2, 2, in], swaps the middle axes back to
[heads, 2, d/2, in] and flattens. Other architectures (qwen2, qwen3) are
stored unpermuted.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from torch import nn
from transformers import PretrainedConfig

from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.models.utils import WeightLoadError


class _GGUFReader(GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map (same bytes, same fields).

    The reader slices its `data` hundreds of thousands of times while it walks
    the header (the bundled file's 49k-entry vocabulary); on an `np.memmap`
    every slice runs memmap's Python-level `__array_finalize__`. A plain view
    of the same map skips that: 1.93 -> 0.64-0.77 s for the bundled SmolLM2
    GGUF on the 2-core dev machine (2026-12-03), once per engine start. Read
    mode only; the map stays open through the view's base.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)


_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.1 files carry precomputed rope frequency factors; the model derives
# the same from config.rope_parameters, so the tensor is not needed.
_IGNORED = {"rope_freqs.weight"}

_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_QUANT_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
SUPPORTED_GGUF_TYPES = tuple(t.name for t in (*_FLOAT_TYPES, *_QUANT_TYPES))


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None when it is not a known tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def read_gguf_architecture(reader: GGUFReader) -> str:
    """The `general.architecture` string of the file ("llama", "qwen2", ...)."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("GGUF metadata has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def gguf_tensor_to_torch(tensor, path: str | Path = "") -> torch.Tensor:
    """A GGUF reader tensor as a torch tensor of its logical shape (HF order: [out, in]).

    Raises:
        ValueError: an unsupported tensor type (names file, tensor and type).
    """
    shape = tuple(int(d) for d in reversed(tensor.shape))
    qtype = tensor.tensor_type
    if qtype in _FLOAT_TYPES:
        raw = tensor.data
        if qtype == GGMLQuantizationType.BF16:
            raw = raw.view(np.int16)
        with warnings.catch_warnings():
            # The memory map is read-only; the tensor is only ever read (copied into a parameter).
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
        if qtype == GGMLQuantizationType.BF16:
            t = t.view(torch.bfloat16)
        return t.reshape(shape)
    if qtype in _QUANT_TYPES:
        return torch.from_numpy(dequantize(tensor.data, qtype)).reshape(shape)
    raise ValueError(
        f"{path}: tensor {tensor.name!r} has type {qtype.name}, which is not supported; "
        f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
    )


def undo_llama_qk_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a llama.cpp-permuted attn_q/attn_k in HF order.

    weight: [num_heads * head_dim, in] (or a bias [num_heads * head_dim]); returns the same shape.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


class GGUFWeights:
    """Iterates (HF name, tensor) over a GGUF file; remembers HF -> GGUF names for errors."""

    def __init__(self, path: str | Path, hf_config: PretrainedConfig) -> None:
        self.path = Path(path)
        self.reader = _GGUFReader(self.path)
        self.architecture = read_gguf_architecture(self.reader)
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.gguf_names: dict[str, str] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        unknown = [
            t.name
            for t in self.reader.tensors
            if t.name not in _IGNORED and gguf_to_hf_name(t.name) is None
        ]
        if unknown:
            raise ValueError(f"{self.path}: unknown GGUF tensors {unknown}")
        for tensor in self.reader.tensors:
            if tensor.name in _IGNORED:
                continue
            hf_name = gguf_to_hf_name(tensor.name)
            self.gguf_names[hf_name] = tensor.name
            weight = gguf_tensor_to_torch(tensor, self.path)
            if self.architecture == "llama":
                if ".self_attn.q_proj." in hf_name:
                    weight = undo_llama_qk_permutation(weight, self.num_heads)
                elif ".self_attn.k_proj." in hf_name:
                    weight = undo_llama_qk_permutation(weight, self.num_kv_heads)
            yield hf_name, weight


class GGUFModelLoader(BaseModelLoader):
    """load_format "gguf" (and "auto" for a .gguf file)."""

    def validate(self, model_path: str) -> None:
        if not Path(model_path).is_file():
            raise FileNotFoundError(f"GGUF file {model_path} does not exist")

    def load_weights(self, model: nn.Module, model_path: str) -> set[str]:
        self.validate(model_path)
        weights = GGUFWeights(model_path, model.config)
        try:
            return model.load_weights(weights)
        except WeightLoadError as e:
            gguf_name = weights.gguf_names.get(e.tensor_name, "?")
            raise ValueError(f"{model_path}: GGUF tensor {gguf_name!r}: {e}") from e
        except ValueError as e:
            if str(e).startswith(str(model_path)):
                raise
            raise ValueError(f"{model_path}: {e}") from e
