"""Tokenizers: converted from the bundled GGUF once, then loaded from the cache."""

from __future__ import annotations

import pytest
from gguf import GGUFReader

import vllm.transformers_utils.tokenizer as tokenizer_module
from vllm.transformers_utils.config import get_bundled_model_path
from vllm.transformers_utils.tokenizer import copy_tokenizer, get_tokenizer, load_tokenizer

# transformers' GGUF tokenizer conversion of the bundled file, measured directly.
CAPITAL_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def gguf_chat_template(path: str) -> str:
    field = GGUFReader(path).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def test_gguf_tokenizer_converted_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    path = get_bundled_model_path()
    tokenizer = load_tokenizer(path)
    assert tokenizer("The capital of France is").input_ids == CAPITAL_IDS
    assert tokenizer.chat_template == gguf_chat_template(path)
    assert tokenizer.eos_token == "<|im_end|>"
    (entry,) = (tmp_path / "gguf").iterdir()
    assert (entry / "tokenizer" / "tokenizer.json").is_file()

    real = tokenizer_module.AutoTokenizer.from_pretrained

    def no_gguf(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the cached tokenizer should have been used"
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", no_gguf)
    again = load_tokenizer(path)
    assert again("The capital of France is").input_ids == CAPITAL_IDS
    assert again.chat_template == tokenizer.chat_template

    # The saved files form an ordinary HF tokenizer directory.
    from_dir = load_tokenizer(str(entry / "tokenizer"))
    assert from_dir("The capital of France is").input_ids == CAPITAL_IDS


def test_missing_tokenizer_path():
    with pytest.raises(FileNotFoundError, match=r"'/nonexistent/tok' not found"):
        get_tokenizer("/nonexistent/tok")


def test_one_tokenizer_per_process_and_key(tmp_path, monkeypatch):
    """The frontend, the detokenizer and the structured-output backends' builds share
    one load; another path spelling of the same file is the same key; other loading
    arguments are another key."""
    from vllm.v1.structured_output import backend_tokenizers
    from vllm.v1.structured_output.backend_tokenizers import TokenizerKey

    monkeypatch.setattr(tokenizer_module, "_TOKENIZERS", {})
    loads = []
    real = tokenizer_module.load_tokenizer

    def counted(*args, **kwargs):
        loads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", counted)
    path = get_bundled_model_path()
    link = tmp_path / "model.gguf"
    link.symlink_to(path)
    tokenizer = get_tokenizer(path)
    assert get_tokenizer(str(link)) is tokenizer
    key = TokenizerKey("xgrammar", str(path), len(tokenizer), (tokenizer.eos_token_id,))
    assert backend_tokenizers._build(key).tokenizer is tokenizer
    assert len(loads) == 1
    assert get_tokenizer(path, trust_remote_code=True) is not tokenizer
    assert len(loads) == 2

    copied = copy_tokenizer(tokenizer)  # a thread's own: equal, not the same object
    assert copied is not tokenizer and copied.backend_tokenizer is not tokenizer.backend_tokenizer
    assert copied("The capital of France is").input_ids == CAPITAL_IDS
    assert copied.chat_template == tokenizer.chat_template
    assert copied.eos_token_id == tokenizer.eos_token_id
    assert len(loads) == 2
