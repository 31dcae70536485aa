"""Shared test helpers: model directories built on the fly (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Hello world, this is a small corpus for a tiny byte-level tokenizer.",
    "Numbers like 1234567890 and symbols such as !?;:()[]{} appear too.",
    "A KV cache stores keys and values of attention for every token.",
]


def write_tokenizer(directory: Path, vocab_size: int = 400, model_vocab_size: int = 0) -> None:
    """A byte-level BPE tokenizer (trained on a tiny corpus) saved with a ChatML template.

    Token ids: 0 = <|endoftext|> (BOS/EOS/pad), 1 = <|im_start|>, 2 = <|im_end|>.
    Ids from the trained vocabulary up to `model_vocab_size` are added tokens
    " w<id>", so every id a random-weight model samples decodes to text (a
    streaming client then sees one chunk per token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    if model_vocab_size > len(fast):
        fast.add_tokens([f" w{i}" for i in range(len(fast), model_vocab_size)])
    fast.save_pretrained(directory)


def make_model_dir(directory: Path, config, *, weights: bool, seed: int = 0) -> Path:
    """An HF model directory: config.json, tokenizer, and random safetensors weights.

    Args:
        config: a transformers PretrainedConfig (eos/bos ids are set to 0).
        weights: write random weights (fp32, N(0, 0.2), norms near 1) with
            transformers; False writes only the config (load with load_format="dummy").
    """
    import torch
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config.bos_token_id = 0
    config.eos_token_id = 0
    if weights:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1 + 0.2 * torch.randn_like(param))
                else:
                    param.normal_(0.0, 0.2)
        model.save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    write_tokenizer(directory, model_vocab_size=config.vocab_size)
    return directory


# The layout every tiny test model shares (llama_config here, the checkpoints of
# tests/model_executor/hf_checkpoints.py): hidden 64, 2 layers, 4 query / 2 KV heads.
TINY_LAYOUT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
)


def llama_config(**overrides):
    """A small Llama config (fast on CPU), overridable."""
    from transformers import LlamaConfig

    base = dict(
        TINY_LAYOUT,
        vocab_size=512,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**base, **overrides})


def smollm2_config():
    """SmolLM2-135M's shape (as in the bundled GGUF)."""
    return llama_config(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )


def llama3_8b_config(**overrides):
    """Llama-3-8B's shape (8192 positions, plain rope theta 5e5), overridable."""
    shape = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    return llama_config(**{**shape, **overrides})


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
