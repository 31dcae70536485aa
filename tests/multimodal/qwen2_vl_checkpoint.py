"""Test helper: a tiny random Qwen2-VL checkpoint (config, fp32 weights, tokenizer with the
vision tokens, image processor) written with transformers, and images of given sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.model_dirs import write_tokenizer

# Text ids of the tiny model; the tokenizer gets the vision tokens at these ids.
VOCAB_SIZE = 512
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 508, 509, 510, 511
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# The image processor's bounds: 4..16 tokens an image ((14 * 2)^2 pixels a token).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_vl_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )


def make_qwen2_vl_dir(directory: Path, seed: int = 0) -> Path:
    """config.json, model.safetensors (fp32, N(0, 0.2), norms near 1), tokenizer, processor."""
    from transformers import Qwen2VLForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(qwen2_vl_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    _write_tokenizer_and_processor(directory, model.config, MIN_PIXELS, MAX_PIXELS)
    return directory


def qwen2_vl_2b_config():
    """Qwen2-VL-2B-Instruct's shape (config.json of the hub checkpoint)."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
            eos_token_id=151645, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                  "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16,
                           mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu"),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645, architectures=["Qwen2VLForConditionalGeneration"],
    )


def make_qwen2_vl_config_dir(directory: Path, config, min_pixels: int = 3136,
                             max_pixels: int = 12845056) -> Path:
    """A config-only Qwen2-VL directory (load with load_format="dummy"): config, tokenizer
    with the vision tokens at the config's ids, the image processor (Qwen2-VL's defaults)."""
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    _write_tokenizer_and_processor(directory, config, min_pixels, max_pixels)
    return directory


def _write_tokenizer_and_processor(directory: Path, config, min_pixels: int,
                                   max_pixels: int) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokens = {config.vision_start_token_id: "<|vision_start|>",
              config.vision_end_token_id: "<|vision_end|>",
              config.image_token_id: "<|image_pad|>", config.video_token_id: "<|video_pad|>"}
    start = min(tokens)
    write_tokenizer(directory, model_vocab_size=start)
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    ordered = [tokens.get(i, f"<|reserved_{i}|>") for i in range(start, max(tokens) + 1)]
    tok.add_special_tokens({"additional_special_tokens": ordered})
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(
        directory)


def image(width: int, height: int, seed: int):
    """A random RGB PIL image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_generate(directory: Path, prompt_ids: list[int], images: list, max_tokens: int
                ) -> list[int]:
    """transformers' greedy generate on the same checkpoint (its processor's pixels)."""
    from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()
    kwargs = {}
    if images:
        processor = AutoImageProcessor.from_pretrained(directory)
        out = processor(images=images, return_tensors="pt")
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        merge = processor.merge_size
        expanded, k = [], 0
        for t in prompt_ids:
            if t == IMAGE_TOKEN_ID:
                expanded += [t] * int(out["image_grid_thw"][k].prod() // merge ** 2)
                k += 1
            else:
                expanded.append(t)
        prompt_ids = expanded
    ids = torch.tensor([prompt_ids])
    mm_type = (ids == IMAGE_TOKEN_ID).int()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_type,
                             max_new_tokens=max_tokens, do_sample=False, **kwargs)
    return gen[0, len(prompt_ids):].tolist()
