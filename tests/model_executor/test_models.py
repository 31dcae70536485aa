"""Llama / Qwen2 / Qwen3 logits equal transformers' on the same random-weight checkpoint.

Each model runs a realistic schedule through the paged KV cache (prefill,
chunked prefill over cached context, decodes, a request joining mid-way,
padding tokens and padding requests) and every logit row is compared with
transformers' full-sequence forward (eager attention, float32).
"""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.generation import run_schedule, schedule_sequences
from tests.model_executor.hf_checkpoints import make_hf_model, save_checkpoint
from tests.model_executor.paged_kv import PagedKVHarness
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.utils import get_attention_layers
from vllm.transformers_utils.config import get_hf_config

ATOL = RTOL = 5e-5


@pytest.mark.parametrize(
    "name, block_size, shard",
    [
        ("llama", 4, None),
        ("llama3_rope_tied", 16, None),
        ("qwen2", 4, None),
        ("qwen3", 8, None),
        ("llama", 4, "60KB"),  # sharded checkpoint with an index
    ],
)
def test_logits_match_transformers(tmp_path, name, block_size, shard):
    hf_model = make_hf_model(name)
    save_checkpoint(hf_model, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = get_model(str(tmp_path), get_hf_config(str(tmp_path)), torch.float32, "cpu")

    sequences = schedule_sequences(hf_model.config.vocab_size)
    got = run_schedule(model, sequences, block_size)
    with torch.no_grad():
        for key, tokens in sequences.items():
            expected = hf_model(tokens[None]).logits[0].float()
            torch.testing.assert_close(got[key], expected, atol=ATOL, rtol=RTOL)


def test_model_interface(tmp_path):
    hf_model = make_hf_model("qwen3")
    save_checkpoint(hf_model, tmp_path)
    model = get_model(str(tmp_path), get_hf_config(str(tmp_path)), torch.float32, "cpu")
    layers = get_attention_layers(model)
    assert list(layers) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert {(a.num_heads, a.num_kv_heads, a.head_size) for a in layers.values()} == {(4, 2, 24)}
    # Without attention metadata (the profiling run) the model still runs, and
    # logits are float32 [N, vocab].
    from vllm.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(None):
        hidden = model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
        logits = model.compute_logits(hidden)
    assert hidden.shape == (3, 64) and logits.shape == (3, 101) and logits.dtype == torch.float32


def test_tied_and_untied_heads(tmp_path):
    tied = make_hf_model("qwen2")
    untied = make_hf_model("llama")
    save_checkpoint(tied, tmp_path / "tied")
    save_checkpoint(untied, tmp_path / "untied")
    m_tied = get_model(
        str(tmp_path / "tied"), get_hf_config(str(tmp_path / "tied")), torch.float32, "cpu"
    )
    m_untied = get_model(
        str(tmp_path / "untied"), get_hf_config(str(tmp_path / "untied")), torch.float32, "cpu"
    )
    assert m_tied.lm_head.weight is m_tied.model.embed_tokens.weight
    assert m_untied.lm_head.weight is not m_untied.model.embed_tokens.weight
    torch.testing.assert_close(m_untied.lm_head.weight, untied.lm_head.weight, atol=0, rtol=0)


def test_bf16_model_runs_in_bf16(tmp_path):
    hf_model = make_hf_model("llama")
    save_checkpoint(hf_model, tmp_path)
    model = get_model(str(tmp_path), get_hf_config(str(tmp_path)), torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    tokens = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(3))
    (logits,) = PagedKVHarness(model).step([("a", tokens.tolist())])
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
    # bf16 against the fp32 reference: close, not equal. Logits come in the model's
    # dtype (the sampler computes in float32), as vLLM's do.
    assert logits.dtype == torch.bfloat16
    logits = logits.float()
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
