"""EncoderSizing: the encoder cache held and the worst case run at the configured budget,
halved on the device's OOM down to one worst-case image, and then a clear error."""

from __future__ import annotations

import pytest
import torch

from tests.multimodal.qwen2_vl_checkpoint import qwen2_vl_config
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vllm.v1.worker.encoder_sizing import EncoderSizing
from vllm.v1.worker.mm_runner import MultiModalRunner

GRID = (1, 8, 8)  # 64 patches -> 16 tokens (merge 2)
PATCH_DIM = 3 * 2 * 14 * 14


class FakeOOM(RuntimeError):
    pass


def _sizing(fits_up_to: int, budget: int = 128):
    """A tiny Qwen2-VL whose vision tower 'runs out of memory' above `fits_up_to` tokens;
    returns the sizing and the token counts it was asked to encode."""
    model = Qwen2VLForConditionalGeneration(qwen2_vl_config())
    real, asked = model.embed_multimodal, []

    def embed(pixels, grids):
        asked.append(sum(t * h * w for t, h, w in grids) // 4)
        if asked[-1] > fits_up_to:
            raise FakeOOM("CUDA out of memory")
        return real(pixels, grids)

    model.embed_multimodal = embed
    mm = MultiModalRunner(model, torch.device("cpu"), torch.float32, 64)
    sizing = EncoderSizing(mm, budget, budget, 16, GRID, PATCH_DIM,
                           is_oom=lambda e: isinstance(e, FakeOOM), empty_cache=lambda: None)
    return sizing, mm, asked


def test_the_configured_budget_when_it_fits():
    sizing, mm, asked = _sizing(fits_up_to=128)
    budget = sizing.reserve()
    assert asked == [128]
    assert (budget.max_num_encoder_input_tokens, budget.encoder_cache_size) == (128, 128)
    assert budget.cache_bytes == 128 * 64 * 4 == mm.cache_bytes
    assert "halved" not in budget.describe()


def test_halves_until_the_worst_case_fits():
    sizing, mm, asked = _sizing(fits_up_to=40)
    budget = sizing.reserve()
    assert asked == [128, 64, 32]
    assert (budget.max_num_encoder_input_tokens, budget.encoder_cache_size) == (32, 32)
    assert mm.cache.shape == (32, 64)
    assert "halved from 128 to fit the device" in budget.describe()


def test_not_even_one_image_is_a_clear_error():
    sizing, mm, asked = _sizing(fits_up_to=8)
    with pytest.raises(RuntimeError, match="one image of 16 tokens"):
        sizing.reserve()
    assert asked == [128, 64, 32, 16] and mm.cache is None


def test_other_errors_are_not_retried():
    sizing, _, asked = _sizing(fits_up_to=128)
    sizing.is_oom = lambda e: False
    sizing.mm.model.embed_multimodal = lambda *a: (_ for _ in ()).throw(ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        sizing.reserve()
