"""Tensor parallelism over 2 CPU processes (gloo) driven by the `mp` executor: sharded
weights (HF safetensors and GGUF), all-reduce and all-gather give the logits of one process."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.gguf_files import write_gguf
from tests.model_executor.hf_checkpoints import make_hf_model, save_checkpoint
from tests.v1.executor.conftest import make_config
from tests.v1.executor.workers import ModelWorker
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

# llama3_rope_tied: 1 kv head (replicated on both ranks), tied head, odd vocab
# (101: the last vocab shard is padded). qwen2: 2 kv heads (split), q/k/v bias.
# qwen3: q/k norms, head_dim apart from hidden / heads. uneven: 6 query and 3 KV
# heads, which 2 ranks split 4+2 / 2+1 (SmolLM2-135M's 9/3 has the same shape).
MODELS = {
    "llama3_rope_tied": ("llama3_rope_tied", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "uneven": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                            intermediate_size=128)),
}
GGUF = "uneven.gguf"  # the uneven llama again, quantized (Q4/Q8/F16/BF16) in a GGUF file


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    paths = {}
    for name, (kind, overrides) in MODELS.items():
        model = make_hf_model(kind, **overrides)
        paths[name] = str(save_checkpoint(model, root / name))
    model = make_hf_model(MODELS["uneven"][0], **MODELS["uneven"][1])
    write_gguf(root / GGUF, model, "llama")
    paths[GGUF] = str(root / GGUF)
    return paths


@pytest.fixture(scope="module")
def tp1():
    """The reference: one rank in this process (no process group at all)."""
    return ModelWorker(make_config(1, "uni"), 0, 0, None, True)


@pytest.fixture(scope="module")
def tp2():
    executor = MultiprocExecutor(make_config(2, "mp", worker="ModelWorker"))
    executor.collective_rpc(ModelWorker.init_device)
    yield executor
    executor.shutdown()


@pytest.mark.parametrize("name", [*MODELS, GGUF])
def test_tp2_matches_tp1(name, checkpoints, tp1, tp2):
    path = checkpoints[name]
    config_path = checkpoints["uneven"] if name == GGUF else None
    reference = tp1.forward_logits(path, config_path)
    ranks = tp2.collective_rpc(ModelWorker.forward_logits, args=(path, config_path))
    for got in ranks:
        assert got.keys() == reference.keys()
        for key, logits in reference.items():
            torch.testing.assert_close(got[key], logits, atol=5e-5, rtol=5e-5)
    # The ranks end with the very same logits (all-gathered), not merely close ones.
    for key in reference:
        assert torch.equal(ranks[0][key], ranks[1][key])
