"""The vision encoder's share of device memory, reserved before the KV cache is sized.

    load_model  -> EncoderSizing(...)                      (multimodal models only)
    _profile    -> reserve(measure_peak):  for budget B = the configured budget,
                   B/2, B/4, ... down to one worst-case image:
                     allocate the encoder cache [cache_size, hidden]  (steady, held)
                     run the vision tower over B tokens of worst-case images
                     (transient: inside the profile's peak)
                     fits -> keep; device OOM -> free both, halve, retry
                -> EncoderBudget (to the scheduler through the StartupPlan, and the log)

Why here: the KV cache takes what the profile leaves. If the encoder's worst
case and its cache were not held while memory is measured, that memory would
be credited to the KV cache and the first large image would OOM inside the
vision tower. The cache stays allocated for the engine's life (the runner's
`MultiModalRunner.cache`), and the worst-case transient is part of the
profiled activation peak the sizing leaves free (classic and extensible path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.logger import init_logger
from vllm.v1.worker.mm_runner import MultiModalRunner

logger = init_logger(__name__)


@dataclass(frozen=True)
class EncoderBudget:
    """What start-up reserved for the vision encoder.

    Attributes:
        max_num_encoder_input_tokens: encoder tokens one step may compute.
        encoder_cache_size: encoder output tokens the cache holds.
        max_tokens_per_item: tokens of the largest image (the floor of both).
        cache_bytes: bytes of the encoder cache.
        configured: the budget asked for (larger when start-up halved it).
    """

    max_num_encoder_input_tokens: int
    encoder_cache_size: int
    max_tokens_per_item: int
    cache_bytes: int
    configured: int

    def describe(self) -> str:
        halved = (f", halved from {self.configured} to fit the device"
                  if self.configured > self.max_num_encoder_input_tokens else "")
        return (f"encoder_budget={self.max_num_encoder_input_tokens} tokens/step, "
                f"encoder_cache={self.encoder_cache_size} tokens "
                f"({self.cache_bytes / 2**30:.2f} GiB){halved}")


class EncoderSizing:
    """Reserves the encoder cache and profiles the encoder's worst case, halving on OOM.

    Args:
        mm: the runner's `MultiModalRunner` (owns the cache tensor).
        model_path: the checkpoint (its image processor gives the worst-case image).
        budget, cache_size: the configured encoder budget and cache size (tokens).
        max_tokens_per_item: tokens of the largest image.
        grid: that image's (t, h, w) patch grid; patch_dim: values per patch.
        is_oom: whether an exception is the device running out of memory.
        empty_cache: return torch's cached blocks to the device (after an OOM).
    """

    def __init__(self, mm: MultiModalRunner, budget: int, cache_size: int,
                 max_tokens_per_item: int, grid: tuple[int, int, int], patch_dim: int,
                 is_oom: Callable[[BaseException], bool], empty_cache: Callable[[], None]
                 ) -> None:
        self.mm = mm
        self.budget = budget
        self.cache_size = cache_size
        self.max_tokens_per_item = max_tokens_per_item
        self.grid = grid
        self.patch_dim = patch_dim
        self.is_oom = is_oom
        self.empty_cache = empty_cache

    def reserve(self) -> EncoderBudget:
        """Allocate the cache and run the worst case at the largest budget that fits.

        Raises:
            RuntimeError: not even one worst-case image fits (the message names it).
        """
        budget, cache_size = self.budget, self.cache_size
        while True:
            try:
                self.mm.allocate_cache(cache_size)
                self.run_worst_case(budget)
                break
            except Exception as e:  # only the device's OOM is retried
                if not self.is_oom(e):
                    raise
                self.mm.cache = None
                self.empty_cache()
                if budget <= self.max_tokens_per_item:
                    raise RuntimeError(
                        f"the vision encoder's worst case (one image of "
                        f"{self.max_tokens_per_item} tokens, grid {self.grid}) does not fit "
                        "beside the model: lower the image processor's max_pixels or use a "
                        "larger device") from e
                budget = max(budget // 2, self.max_tokens_per_item)
                cache_size = max(cache_size // 2, self.max_tokens_per_item)
                logger.warning("The encoder's worst case does not fit the device; halving "
                               "the encoder budget to %d tokens", budget)
        result = EncoderBudget(budget, cache_size, self.max_tokens_per_item,
                               self.mm.cache_bytes, self.budget)
        logger.info("Encoder reserved: %s", result.describe())
        return result

    @torch.inference_mode()
    def run_worst_case(self, budget: int) -> None:
        """The vision tower over `budget` tokens of worst-case images (nothing kept):
        its transient peak, and on CUDA its kernels compiled before any request."""
        items = self.mm.worst_case_features(budget, self.max_tokens_per_item, self.grid,
                                            self.patch_dim)
        pixels = torch.cat([f.data["pixel_values"] for f in items]).to(self.mm.device)
        out = self.mm.model.embed_multimodal(pixels, [f.grid_thw for f in items])
        # Into the cache's first rows, as serving writes: the copy's kernel too.
        rows = min(out.shape[0], self.mm.cache.shape[0])
        self.mm.cache[:rows].copy_(out[:rows])
        del out, pixels


def encoder_sizing(mm: MultiModalRunner, config, platform) -> EncoderSizing:
    """The sizing of `config`'s multimodal model (its image processor's worst case,
    the configured budget: max(max_num_batched_tokens, one worst-case image))."""
    from vllm.multimodal.processing import image_token_limits, load_image_processor

    processor = load_image_processor(config.model_config.model)
    max_tokens, grid = image_token_limits(processor)
    budget, cache_size = config.multimodal_config.encoder_budget(
        config.scheduler_config.max_num_batched_tokens, max_tokens)
    patch_dim = 3 * int(processor.temporal_patch_size) * int(processor.patch_size) ** 2
    return EncoderSizing(mm, budget, cache_size, max_tokens, grid, patch_dim,
                         is_oom=lambda e: isinstance(e, torch.OutOfMemoryError),
                         empty_cache=platform.empty_cache)
