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
    from transformers import PreTrainedTokenizerFast, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

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
    write_tokenizer(directory, model_vocab_size=IMAGE_TOKEN_ID)
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]})
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_TOKEN_ID
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(
        directory)
    return directory


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
