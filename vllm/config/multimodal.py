"""`MultiModalConfig`: images per prompt, local media, the encoder's budget and cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from vllm.config.frozen import FrozenConfig

# vLLM's default limit per modality when --limit-mm-per-prompt leaves it unset.
DEFAULT_LIMIT_PER_PROMPT = 999


@dataclass
class MultiModalConfig(FrozenConfig):
    """How a multimodal model takes images.

    A text-only model takes none: flags set for it are accepted, as vLLM
    accepts them, and `VllmConfig` warns once that they have no effect
    (`flags_given`).

    Attributes:
        limit_mm_per_prompt: most items per modality in one prompt, vLLM's
            `--limit-mm-per-prompt '{"image": 2}'`; unset modalities get 999.
        allowed_local_media_path: the directory `file://` image URLs may read
            (None: file:// is refused).
        max_num_encoder_input_tokens: encoder output tokens (image placeholders)
            computed in one step; None = max(max_num_batched_tokens, one
            worst-case image). Start-up may lower it (never below one
            worst-case image) when the worst case does not fit the device.
        encoder_cache_size: encoder output tokens kept until their placeholders
            are computed; None = the encoder budget.

    Raises:
        ValueError: a limit that is not an int >= 0, an unknown modality, a
            budget < 1, an allowed_local_media_path that is not a directory.
    """

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    allowed_local_media_path: str | None = None
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    # The flags the user set (vLLM's names), for the warning a text-only model gives.
    flags_given: tuple[str, ...] = field(init=False, default=(), compare=False)

    def __post_init__(self) -> None:
        limits = dict(self.limit_mm_per_prompt or {})
        self.flags_given = tuple(f"--{name.replace('_', '-')}" for name, given in (
            ("limit_mm_per_prompt", bool(limits)),
            ("allowed_local_media_path", bool(self.allowed_local_media_path)),
            ("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens is not None),
            ("encoder_cache_size", self.encoder_cache_size is not None)) if given)
        for modality, limit in limits.items():
            if modality != "image":
                raise ValueError(f"limit_mm_per_prompt: modality {modality!r} is not "
                                 "supported; supported: image")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt: {modality} must be an int >= 0, "
                                 f"got {limit!r}")
        self.limit_mm_per_prompt = {"image": limits.get("image", DEFAULT_LIMIT_PER_PROMPT)}
        path = self.allowed_local_media_path
        if path and not os.path.isdir(path):  # a typo fails at start-up, as in vLLM
            raise ValueError(f"allowed_local_media_path {path!r} is not a directory")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def encoder_budget(self, max_num_batched_tokens: int, max_tokens_per_item: int
                       ) -> tuple[int, int]:
        """(encoder tokens per step, encoder cache size), both at least one worst-case item."""
        budget = self.max_num_encoder_input_tokens or max_num_batched_tokens
        budget = max(budget, max_tokens_per_item)
        return budget, max(self.encoder_cache_size or budget, max_tokens_per_item)


def limit_mm_per_prompt_from_cli(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt` JSON ('{"image": 2}') -> dict; ValueError naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"limit_mm_per_prompt is not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object such as "
                         f"'{{\"image\": 2}}', got {text!r}")
    MultiModalConfig(limit_mm_per_prompt=value)  # checks the values
    return value
