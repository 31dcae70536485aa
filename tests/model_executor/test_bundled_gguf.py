"""The bundled SmolLM2-135M-Instruct GGUF: greedy output equals transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.generation import greedy, hf_greedy
from vllm.model_executor.model_loader import get_model
from vllm.transformers_utils.config import get_bundled_model_path, get_hf_config
from vllm.transformers_utils.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def bundled():
    path = get_bundled_model_path()
    config = get_hf_config(path)
    model = get_model(path, config, torch.float32, "cpu")
    return path, config, model, get_tokenizer(path)


@pytest.fixture(scope="module")
def hf_model(bundled_hf_model):
    return bundled_hf_model


def test_bundled_config(bundled):
    _, config, model, _ = bundled
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (
        30,
        576,
        3,
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied in the file


def test_chat_greedy_matches_transformers(bundled, hf_model):
    _, _, model, tokenizer = bundled
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    ours = greedy(model, prompt, NUM_TOKENS)
    assert ours == hf_greedy(hf_model, prompt, NUM_TOKENS)
    assert "Paris" in tokenizer.decode(ours, skip_special_tokens=True)


def test_plain_prompt_continues_with_paris(bundled, hf_model):
    _, _, model, tokenizer = bundled
    prompt = tokenizer("The capital of France is").input_ids
    ours = greedy(model, prompt, 8)
    assert ours == hf_greedy(hf_model, prompt, 8)
    assert tokenizer.decode(ours).startswith(" Paris")
