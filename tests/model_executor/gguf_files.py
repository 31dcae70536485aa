"""Test helper: write an HF model's weights as a small GGUF file, llama.cpp style."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import PreTrainedModel

_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

# Tensor types by GGUF name fragment: every supported type appears.
DEFAULT_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q4_1,
    "attn_v.weight": Q.BF16,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q4_0,
    "output.weight": Q.F16,
}


def hf_to_gguf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem == "model.embed_tokens":
        return f"token_embd.{suffix}"
    if stem == "model.norm":
        return f"output_norm.{suffix}"
    if stem == "lm_head":
        return f"output.{suffix}"
    _, _, index, rest = stem.split(".", 3)
    return f"blk.{index}.{_HF_TO_GGUF_LAYER[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q/k (pairs halves -> interleaved)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _type_for(gguf_name: str, types: dict[str, Q]) -> Q:
    for fragment, qtype in types.items():
        if fragment in gguf_name:
            return qtype
    return Q.F32


def write_gguf(
    path: Path, model: PreTrainedModel, arch: str, types: dict[str, Q] | None = None
) -> dict[str, torch.Tensor]:
    """Write `model`'s tensors to `path`; returns the HF state dict as the file holds it (after
    quantization), in HF layout: load it into the HF model to get the reference."""
    types = DEFAULT_TYPES if types is None else types
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    roundtrip = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = hf_to_gguf_name(name)
        data = tensor.float().numpy()
        qtype = _type_for(gguf_name, types) if data.ndim == 2 else Q.F32
        if qtype == Q.F32:
            stored, back = data, data
        elif qtype == Q.F16:
            stored = data.astype(np.float16)
            back = stored.astype(np.float32)
        else:
            stored = gguf.quants.quantize(data, qtype)
            back = gguf.quants.dequantize(stored, qtype)
        roundtrip[name] = torch.from_numpy(np.ascontiguousarray(back))
        if arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(stored, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(stored, config.num_key_value_heads)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, np.ascontiguousarray(stored))
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(stored), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return roundtrip
