"""The checkpoint's image processor and placeholder expansion: images -> features.

    prompt ids  ... <|vision_start|> <|image_pad|> <|vision_end|> ...   (one pad per image)
    image       -> transformers' image processor for the checkpoint (resize to a multiple
                   of patch * merge within min/max pixels, normalise, cut into patches)
                -> pixel_values [t*h*w, C*T_p*P*P], image_grid_thw (t, h, w)
    expanded    ... <|vision_start|> <|image_pad|> x (t*h*w / merge^2) <|vision_end|> ...

Resizing and normalising are transformers' (the checkpoint's preprocessor
config), never ours. Each image is processed alone, so its pixels and its hash
do not depend on the other images of the prompt.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.multimodal.media import MediaConnector, to_rgb

# The modalities a prompt's "multi_modal_data" may hold.
SUPPORTED_MODALITIES = ("image",)


class MultiModalProcessor:
    """Turns a prompt's images into `MultiModalFeatureSpec`s and expands their placeholders.

    Chat messages bring images as content parts (`chat_images`): {"type": "image_url",
    "image_url": {"url": ...}} (data:, http(s):, file: through `media`) or vLLM's
    {"type": "image_pil", "image_pil": <PIL image>} (offline); each becomes the
    model's placeholder text in the message.

    Args:
        image_processor: the checkpoint's transformers image processor.
        image_token_id: the placeholder token (<|image_pad|>).
        merge_size: spatial merge of the vision tower (patches per token = merge^2).
        limit_per_prompt: most items per modality in one prompt ({"image": n}).
        max_tokens_per_item: most placeholder tokens one image may take (the
            encoder cache's size: an image that cannot fit it can never run).
        media: loads image URLs of chat messages (None: a plain MediaConnector,
            file:// refused).
    """

    # The text one image stands for in a prompt (Qwen2-VL's chat template writes it).
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, image_processor: Any, image_token_id: int, merge_size: int,
                 limit_per_prompt: dict[str, int], max_tokens_per_item: int,
                 media: MediaConnector | None = None) -> None:
        self.media = media or MediaConnector()
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.limit_per_prompt = limit_per_prompt
        self.max_tokens_per_item = max_tokens_per_item

    @classmethod
    def for_checkpoint(cls, model_path: str, hf_config: Any, limit_per_prompt: dict[str, int],
                       max_tokens_per_item: int, allowed_local_media_path: str | None
                       ) -> MultiModalProcessor:
        """The processor of the checkpoint at `model_path` (its preprocessor config) with
        its HF config's image token and merge size."""
        return cls(load_image_processor(model_path), int(hf_config.image_token_id),
                   int(hf_config.vision_config.spatial_merge_size), limit_per_prompt,
                   max_tokens_per_item, MediaConnector(allowed_local_media_path))

    def chat_images(self, conversation: list[Any]
                    ) -> tuple[list[Any], list[Any], list[str]]:
        """(the conversation with every image part replaced by a text part holding the
        placeholder, the images in order, the request field each came from:
        "messages.0.content.1.image_url.url", for `process`'s `item_params`).
        Messages that are not dicts pass unchanged (the renderer names them).

        Raises:
            VLLMValidationError (parameter "messages.i.content.j..."): an image that
                cannot be loaded (see `MediaConnector.load_image`), an image_pil that
                is not a PIL image, more images than --limit-mm-per-prompt.
        """
        from PIL import Image

        limit = self.limit_per_prompt.get("image", 0)
        images: list[Any] = []
        params: list[str] = []
        out = []
        for i, message in enumerate(conversation):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                out.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("image_url", "image_pil"):
                    parts.append(part)
                    continue
                where = f"messages.{i}.content.{j}.{kind}"
                if len(images) >= limit:
                    raise VLLMValidationError(
                        f"{where}: more than {limit} image(s) in one prompt "
                        "(--limit-mm-per-prompt)", parameter=where)
                value = part.get(kind)
                if kind == "image_pil":
                    if not isinstance(value, Image.Image):
                        raise VLLMValidationError(f"{where} must be a PIL image",
                                                  parameter=where)
                    images.append(value)
                    params.append(where)
                else:
                    url = value.get("url") if isinstance(value, dict) else value
                    params.append(f"{where}.url" if isinstance(value, dict) else where)
                    images.append(self.media.load_image(url, params[-1]))
                parts.append({"type": "text", "text": self.placeholder})
            out.append({**message, "content": parts})
        return out, images, params

    def process(self, prompt_token_ids: list[int], mm_data: Any, where: str = "multi_modal_data",
                item_params: list[str] | None = None
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(expanded token ids, one feature per image in prompt order).

        Args:
            mm_data: {"image": a PIL image or a list of them}.
            where: the request field to name in errors.
            item_params: the request field of each image, named by the errors about
                one image (chat: `chat_images`' third result); None: `where`.image.k.

        Raises:
            VLLMValidationError (parameter `where`...): not a dict, an unknown
                modality, more images than the limit, an item that is not a PIL
                image or has no pixels (0 x N), placeholders that do not match the
                images, an image with more tokens than `max_tokens_per_item`.
        """
        images = self._images(mm_data, where)
        pads = [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id]
        if len(pads) != len(images):
            raise VLLMValidationError(
                f"{where}: the prompt has {len(pads)} image placeholder token(s) "
                f"(<|image_pad|>, id {self.image_token_id}) for {len(images)} image(s); "
                "write one <|vision_start|><|image_pad|><|vision_end|> per image",
                parameter=where)
        ids: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        last = 0
        for k, (pad, image) in enumerate(zip(pads, images, strict=True)):
            feature_where = (item_params[k] if item_params and len(item_params) == len(images)
                             else f"{where}.image.{k}" if len(images) > 1 else f"{where}.image")
            pixel_values, grid = self._pixels(image, feature_where)
            identifier = _hash(image, grid)
            length = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
            if length > self.max_tokens_per_item:
                raise VLLMValidationError(
                    f"{feature_where}: the image takes {length} tokens, more than the "
                    f"{self.max_tokens_per_item} one image may take", parameter=feature_where)
            ids.extend(prompt_token_ids[last:pad])
            features.append(MultiModalFeatureSpec(
                modality="image", identifier=identifier,
                mm_position=PlaceholderRange(len(ids), length),
                data={"pixel_values": pixel_values, "image_grid_thw": grid}))
            ids.extend([self.image_token_id] * length)
            last = pad + 1
        ids.extend(prompt_token_ids[last:])
        return ids, features

    def _images(self, mm_data: Any, where: str) -> list[Any]:
        from PIL import Image

        if not isinstance(mm_data, dict):
            raise VLLMValidationError(f"{where} must be a dict such as {{'image': image}}",
                                      parameter=where)
        unknown = sorted(set(mm_data) - set(SUPPORTED_MODALITIES))
        if unknown:
            raise VLLMValidationError(f"{where}: modality {unknown[0]!r} is not supported; "
                                      f"supported: {', '.join(SUPPORTED_MODALITIES)}",
                                      parameter=where)
        images = mm_data.get("image", [])
        images = list(images) if isinstance(images, list | tuple) else [images]
        limit = self.limit_per_prompt.get("image", 0)
        if len(images) > limit:
            raise VLLMValidationError(
                f"{where}: {len(images)} images in one prompt, more than the limit {limit} "
                "(--limit-mm-per-prompt)", parameter=where)
        for k, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise VLLMValidationError(f"{where}.image.{k} must be a PIL image, got "
                                          f"{type(image).__name__}", parameter=where)
            if 0 in image.size:
                raise VLLMValidationError(f"{where}.image.{k}: the image has no pixels "
                                          f"({image.width}x{image.height})", parameter=where)
        return images

    def _pixels(self, image: Any, where: str) -> tuple[Any, tuple[int, int, int]]:
        try:
            out = self.image_processor(images=[to_rgb(image)], return_tensors="pt")
        except (ValueError, OSError) as e:
            raise VLLMValidationError(f"{where}: the image processor rejected the image: {e}",
                                      parameter=where) from None
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"].float(), (t, h, w)


def load_image_processor(model_path: str) -> Any:
    """The checkpoint's image processor (preprocessor_config.json), via transformers."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_path)


def _hash(image: Any, grid: tuple[int, int, int]) -> str:
    """The image's content hash (its mode, size and decoded pixels, and the grid the
    processor made of it): equal images share encoder outputs and prefix-cache blocks.
    The decoded pixels, not the processed ones: 8x fewer bytes (uint8, before the
    float32 patches), the same answer for one engine's processor."""
    digest = hashlib.sha256(f"{image.mode}|{image.size}|{grid}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_token_limits(image_processor: Any) -> tuple[int, tuple[int, int, int]]:
    """(most placeholder tokens one image can take, the (t, h, w) patch grid of such an
    image) under the processor's max_pixels: the worst case warmup encodes.

    The processor resizes every image to at most max_pixels pixels, in units of
    (patch * merge)^2 pixels per token, so no image takes more than
    max_pixels // (patch * merge)^2 tokens.
    """
    size = image_processor.size
    max_pixels = (getattr(size, "longest_edge", None)
                  or (size.get("longest_edge") if isinstance(size, dict) else None)
                  or image_processor.max_pixels)
    merge = int(image_processor.merge_size)
    unit = int(image_processor.patch_size) * merge
    max_tokens = max(int(max_pixels) // unit ** 2, 1)
    side = max(math.isqrt(max_tokens), 1)
    return max_tokens, (1, side * merge, (max_tokens // side) * merge)
