"""GGUF weight loading: every supported tensor type, name mapping, the llama q/k
unpermutation, and the errors (unsupported type, shape mismatch, unknown tensor)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.model_executor.gguf_files import write_gguf
from tests.model_executor.hf_checkpoints import make_hf_model
from tests.model_executor.paged_kv import PagedKVHarness
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.gguf_loader import undo_llama_qk_permutation


@pytest.mark.parametrize(
    "name, arch",
    [("llama", "llama"), ("llama3_rope_tied", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")],
)
def test_gguf_logits_match_transformers(tmp_path, name, arch):
    hf_model = make_hf_model(name)
    path = tmp_path / "model.gguf"
    roundtrip = write_gguf(path, hf_model, arch)
    hf_model.load_state_dict(roundtrip, strict=False)  # the reference sees what the file holds
    model = get_model(str(path), hf_model.config, torch.float32, "cpu")

    tokens = torch.randint(0, 101, (13,), generator=torch.Generator().manual_seed(5))
    harness = PagedKVHarness(model, block_size=4)
    prefill = harness.step([("a", tokens[:10].tolist())])[0]
    decodes = [harness.step([("a", [t])])[0] for t in tokens[10:].tolist()]
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
    torch.testing.assert_close(torch.cat([prefill, *decodes]), expected, atol=5e-5, rtol=5e-5)


def test_llama_permutation_roundtrip():
    from tests.model_executor.gguf_files import llama_cpp_permute

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    permuted = torch.from_numpy(llama_cpp_permute(w, 6))
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(undo_llama_qk_permutation(permuted, 6), torch.from_numpy(w))


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    hf_model = make_hf_model("llama")
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    q5k = gguf.GGMLQuantizationType.Q5_K
    block, type_size = gguf.GGML_QUANT_SIZES[q5k]
    writer.add_tensor("token_embd.weight", np.zeros((2, type_size), np.uint8), raw_dtype=q5k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"bad\.gguf.*'token_embd\.weight'.*Q5_K") as info:
        get_model(str(path), hf_model.config, torch.float32, "cpu")
    assert "Q4_1" in str(info.value)  # lists the supported types


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    path = tmp_path / "small.gguf"
    write_gguf(path, make_hf_model("llama"), "llama")
    bigger = make_hf_model("llama", intermediate_size=128).config
    with pytest.raises(
        ValueError,
        match=r"small\.gguf: GGUF tensor 'blk\.0\.ffn_gate\.weight'.*shape mismatch.*\(96, 64\)",
    ):
        get_model(str(path), bigger, torch.float32, "cpu")


def test_unknown_tensor_is_named(tmp_path):
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"extra\.gguf.*blk\.0\.ffn_gate_exps\.weight"):
        get_model(str(path), make_hf_model("llama").config, torch.float32, "cpu")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        get_model(str(tmp_path / "nope.gguf"), make_hf_model("llama").config, torch.float32, "cpu")


def test_reader_is_a_plain_view_of_the_same_fields_and_tensors(tmp_path):
    """The loader's reader (a plain ndarray over the map, for start-up speed) reads exactly
    what `gguf.GGUFReader` reads: every field's parts and every tensor's bytes."""
    from vllm.model_executor.model_loader.gguf_loader import _GGUFReader

    path = tmp_path / "model.gguf"
    write_gguf(path, make_hf_model("qwen2"), "qwen2")
    ours, theirs = _GGUFReader(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        got = ours.fields[name]
        assert got.types == field.types and len(got.parts) == len(field.parts), name
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got.parts, field.parts, strict=True))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.data.tobytes() == b.data.tobytes(), a.name
        assert type(a.data) is np.ndarray
