"""HF-directory loading errors, the registry, load formats and dummy weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_executor.hf_checkpoints import make_hf_model, save_checkpoint
from tests.model_executor.paged_kv import PagedKVHarness
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.registry import ModelRegistry, get_model_architecture
from vllm.transformers_utils.config import get_hf_config


def _load(path, dtype=torch.float32, **kwargs):
    return get_model(str(path), get_hf_config(str(path)), dtype, "cpu", **kwargs)


def test_unknown_architecture_lists_supported(tmp_path):
    config = make_hf_model("llama").config
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3"
    ):
        get_model(str(tmp_path), config, torch.float32, "cpu")


def test_registry_resolves_by_architecture_and_model_type():
    config = make_hf_model("qwen3").config
    assert get_model_architecture(config) == (Qwen3ForCausalLM, "Qwen3ForCausalLM")
    config.architectures = None  # e.g. a GGUF-derived config
    assert get_model_architecture(config)[0] is Qwen3ForCausalLM
    assert ModelRegistry.get_supported_archs() == [
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen2VLForConditionalGeneration",
    ]


def test_missing_shard_names_directory_and_file(tmp_path):
    save_checkpoint(make_hf_model("llama"), tmp_path, "60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}: {victim} is listed"):
        _load(tmp_path)


def test_no_weights_names_directory(tmp_path):
    save_checkpoint(make_hf_model("llama"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}: no \*\.safetensors"):
        _load(tmp_path)


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    save_checkpoint(make_hf_model("llama"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: checkpoint tensor 'model\.layers\.\d\.mlp\.(gate|up|down)_proj"
        r"\.weight'.*shape mismatch",
    ):
        _load(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    save_checkpoint(make_hf_model("qwen2"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert "model.layers.0.mlp.extra.weight" in message
    assert "model.layers.1.self_attn.k_proj.bias" in message


def test_unknown_load_format(tmp_path):
    with pytest.raises(ValueError, match=r"load_format 'pt'.*dummy"):
        get_model(str(tmp_path), make_hf_model("llama").config, torch.float32, "cpu", "pt")


def test_dummy_weights_need_only_the_config(tmp_path):
    config = make_hf_model("llama3_rope_tied").config
    first = get_model(str(tmp_path), config, torch.bfloat16, "cpu", load_format="dummy")
    second = get_model(str(tmp_path), config, torch.bfloat16, "cpu", load_format="dummy")
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b), name  # fixed seed
        assert 0 < a.abs().max() <= 1e-3
    (logits,) = PagedKVHarness(first).step([("a", [1, 2, 3, 4, 5])])
    assert logits.shape == (5, 101) and torch.isfinite(logits).all()
