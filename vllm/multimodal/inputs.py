"""What a multimodal request carries to the engine core (torch-free module).

    prompt token ids:  ... <|vision_start|> P P P ... P <|vision_end|> ...
                                            ^ mm_position.offset, .length placeholders

One `MultiModalFeatureSpec` per image: where its placeholder tokens sit in the
prompt, the processor's output the encoder needs, and its content hash (vLLM's
`mm_hash`), which keys the encoder cache and enters the prefix-cache hashes of
the blocks its placeholders fall into.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions [offset, offset + length) hold one item's placeholder tokens."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalFeatureSpec:
    """One image of a request.

    Attributes:
        modality: "image".
        identifier: hex digest of the decoded image and its grid (the `mm_hash`).
        mm_position: its placeholder tokens in the prompt; `length` is also the
            number of encoder output rows (tokens) it produces.
        data: the processor's output for it: "pixel_values" (torch.Tensor
            [num_patches, C * T_p * P * P] float32) and "image_grid_thw"
            ((t, h, w) patches, ints).
    """

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, Any] = field(repr=False)

    @property
    def num_encoder_tokens(self) -> int:
        return self.mm_position.length

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        t, h, w = self.data["image_grid_thw"]
        return int(t), int(h), int(w)
