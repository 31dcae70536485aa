"""The models on an NVIDIA GPU through the Triton attention backend.

Run on the GPU box:  pytest -q -m cuda tests/model_executor/test_models_cuda.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model_dirs import llama3_8b_config
from tests.model_executor.generation import greedy, hf_greedy, run_schedule, schedule_sequences
from tests.model_executor.hf_checkpoints import make_hf_model, save_checkpoint
from tests.model_executor.paged_kv import PagedKVHarness
from vllm.model_executor.model_loader import get_model
from vllm.transformers_utils.config import get_bundled_model_path, get_hf_config
from vllm.transformers_utils.tokenizer import get_tokenizer

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    # Parity in fp32 needs IEEE matmuls on both sides (no TF32).
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("name", ["llama", "llama3_rope_tied", "qwen2", "qwen3"])
def test_logits_match_transformers_on_cuda(tmp_path, name):
    hf_model = make_hf_model(name)
    save_checkpoint(hf_model, tmp_path)
    model = get_model(str(tmp_path), get_hf_config(str(tmp_path)), torch.float32, "cuda")
    sequences = schedule_sequences(101)
    got = run_schedule(model, sequences, block_size=16)
    with torch.no_grad():
        for key, tokens in sequences.items():
            expected = hf_model(tokens[None]).logits[0]
            torch.testing.assert_close(got[key].cpu(), expected, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def bundled_cuda():
    from transformers import AutoModelForCausalLM

    try:
        path = get_bundled_model_path()
    except FileNotFoundError as e:  # the GPU box may lack the package; say so, do not fail
        pytest.skip(str(e))
    config = get_hf_config(path)
    hf_model = AutoModelForCausalLM.from_pretrained(
        Path(path).parent, gguf_file=Path(path).name, dtype=torch.float32
    )
    return path, config, get_tokenizer(path), hf_model.to("cuda").eval()


def test_bundled_greedy_fp32_matches_transformers(bundled_cuda):
    path, config, tokenizer, hf_model = bundled_cuda
    model = get_model(path, config, torch.float32, "cuda")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    ours = greedy(model, prompt, 32)
    assert ours == hf_greedy(hf_model, prompt, 32)
    assert "Paris" in tokenizer.decode(ours, skip_special_tokens=True)


def test_bundled_bf16_answers_paris(bundled_cuda):
    path, config, tokenizer, _ = bundled_cuda
    model = get_model(path, config, torch.bfloat16, "cuda")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompt = tokenizer("The capital of France is").input_ids
    assert tokenizer.decode(greedy(model, prompt, 4)).startswith(" Paris")


def test_llama3_8b_dummy_weights_on_gpu():
    """Benchmark shapes with no checkpoint: built directly on the GPU in bf16, runs a step."""
    config = llama3_8b_config(
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    )
    model = get_model("unused", config, torch.bfloat16, "cuda", load_format="dummy")
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert all(p.is_cuda for p in model.parameters())
    harness = PagedKVHarness(model, block_size=16, num_blocks=64)
    (logits,) = harness.step([("a", list(range(1, 200)))])
    (logits2,) = harness.step([("a", [7])])
    assert logits.shape == (199, 128256) and torch.isfinite(logits).all()
    assert torch.isfinite(logits2).all()
    del model, harness
    torch.cuda.empty_cache()
