"""`MultiModalRunner`: the model runner's images: the encoder cache, per-request M-RoPE
positions, and the step's input embeddings with image rows written in.

    execute_model
      1. update states   add_request (features, M-RoPE table) / remove
         execute_encoder  drop free_encoder_mm_hashes; encode scheduled_encoder_inputs
                          (one vision-tower call per step) into the encoder cache
      2. prepare inputs  step_inputs: token embeddings, then placeholder rows
                          <- encoder cache rows; positions [3, T]

The encoder cache is ONE tensor [encoder_cache_size, hidden] in the model's
dtype, allocated at start-up (warmup sizes the KV cache with it held) and
never reallocated: an image's output takes any free rows (a row list per
mm_hash), so it cannot fragment. The scheduler's `EncoderCacheManager`
decides what is kept; this class only follows (its free rows can never run
out while the two agree: both count the same tokens).

    cache rows:  [ img A: 0..63 | img B: 64..79 | free | img C: 80..95, 130..177 ]
    step rows:   flat token k is placeholder j of image A  ->  embeds[k] = cache[rows_A[j]]

Positions: the model's `get_mrope_input_positions` gives a request's prompt
positions [3, P] and the delta of the tokens after it (position + delta on all
three rows). Decode graphs read 1-D positions, so `text_positions` hands the
runner `position + delta` for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass
class _Images:
    features: list[Any]  # MultiModalFeatureSpec, in prompt order
    mrope: np.ndarray  # [3, P] int64 prompt positions
    delta: int  # positions after the prompt: position + delta


class MultiModalRunner:
    """Encoder outputs, image rows and M-RoPE positions for the runner.

    Args:
        model: a model with the multimodal interface (`embed_multimodal`,
            `embed_input_ids`, `get_mrope_input_positions`).
        device, dtype: the model's.
        hidden_size: rows of the encoder cache are this wide.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 hidden_size: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.cache: torch.Tensor | None = None  # [encoder_cache_size, hidden]
        self.free_rows: list[int] = []
        self.rows: dict[str, torch.Tensor] = {}  # mm_hash -> [length] int64 cache rows
        self.images: dict[str, _Images] = {}  # req_id -> its images
        # The step `prepare` built: positions [3, total] int64 (host), and (flat token
        # indices, encoder cache rows) of its image tokens or None.
        self.step_positions: np.ndarray | None = None
        self.step_image_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------- cache
    def allocate_cache(self, num_tokens: int) -> None:
        """Allocate the encoder cache of `num_tokens` rows (start-up; replaces any before)."""
        self.cache = None
        self.rows.clear()
        self.cache = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype,
                                 device=self.device)
        self.free_rows = list(range(num_tokens - 1, -1, -1))

    @property
    def cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.numel() * self.cache.element_size()

    def _store(self, mm_hash: str, output: torch.Tensor) -> None:
        n = output.shape[0]
        if n > len(self.free_rows):
            raise RuntimeError(f"encoder cache overflow: {n} rows needed, {len(self.free_rows)} "
                               "free (the scheduler's EncoderCacheManager and the runner "
                               "disagree)")
        rows = [self.free_rows.pop() for _ in range(n)]
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.cache.index_copy_(0, index, output.to(self.dtype))
        self.rows[mm_hash] = index

    def _drop(self, mm_hash: str) -> None:
        index = self.rows.pop(mm_hash, None)
        if index is not None:
            self.free_rows.extend(index.tolist())

    # ---------------------------------------------------------------- requests
    def add_request(self, req_id: str, prompt_token_ids: list[int], features: list[Any]) -> None:
        """Note a new request's images and compute its prompt's M-RoPE positions."""
        grids = [f.grid_thw for f in features]
        rows, delta = self.model.get_mrope_input_positions(prompt_token_ids, grids)
        self.images[req_id] = _Images(list(features), np.asarray(rows, dtype=np.int64), delta)

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.images.pop(req_id, None)

    def execute_encoder(self, so: SchedulerOutput) -> None:
        """Drop the outputs the scheduler evicted, then encode this step's images
        (all of them in one vision-tower call) into the cache."""
        for mm_hash in so.free_encoder_mm_hashes:
            self._drop(mm_hash)
        todo = [self.images[req_id].features[i]
                for req_id, indices in so.scheduled_encoder_inputs.items() for i in indices]
        todo = [f for f in todo if f.identifier not in self.rows]
        if todo:
            self.encode(todo)

    def encode(self, features: list[Any]) -> None:
        """Run the vision tower over `features` and store each output under its hash."""
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(self.device)
        with torch.inference_mode():
            out = self.model.embed_multimodal(pixels, [f.grid_thw for f in features])
        start = 0
        for f in features:
            n = f.num_encoder_tokens
            if f.identifier not in self.rows:
                self._store(f.identifier, out[start:start + n])
            start += n

    # ---------------------------------------------------------------- a step
    def prepare(self, req_ids: list[str], req_indices: np.ndarray, positions: np.ndarray,
                num_sched: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """Build the step's model inputs (kept for `forward_args`); returns the 1-D
        positions decode graphs read: position + the row's delta.

        Args:
            req_ids: the batch's rows; req_indices, positions: [total] each flat
                token's row and position; num_sched, computed:
                [num_reqs] tokens scheduled and computed before the step.
        """
        total = len(positions)
        deltas = np.array([self.images[r].delta if r in self.images else 0 for r in req_ids],
                          dtype=np.int64)
        model_positions = positions + deltas[req_indices] if deltas.any() else positions
        mrope = np.empty((3, total), dtype=np.int64)
        mrope[:] = model_positions
        dst: list[np.ndarray] = []
        src: list[torch.Tensor] = []
        start = 0
        for row, req_id in enumerate(req_ids):
            n, c = int(num_sched[row]), int(computed[row])
            images = self.images.get(req_id)
            if images is not None:
                in_prompt = min(max(images.mrope.shape[1] - c, 0), n)
                mrope[:, start:start + in_prompt] = images.mrope[:, c:c + in_prompt]
                for f in images.features:
                    lo, hi = max(f.mm_position.offset, c), min(f.mm_position.end, c + n)
                    if lo < hi:
                        dst.append(np.arange(start + lo - c, start + hi - c, dtype=np.int64))
                        first = lo - f.mm_position.offset
                        src.append(self.rows[f.identifier][first:first + hi - lo])
            start += n
        self.step_positions = mrope  # uploaded by forward_args: a graph replay reads none
        self.step_image_rows = None
        if dst:
            self.step_image_rows = (torch.from_numpy(np.concatenate(dst)).to(self.device),
                                    torch.cat(src))
        return model_positions

    def forward_args(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(positions [3, total] int64, inputs_embeds [total, hidden] or None) of the
        step `prepare` built, for the eager forward after `input_ids` ([total], on the
        device: with async scheduling the last sampled ids arrive there, not on the host)."""
        positions = torch.from_numpy(self.step_positions).to(self.device)
        if self.step_image_rows is None:
            return positions, None
        flat, rows = self.step_image_rows
        embeds = self.model.embed_input_ids(input_ids)
        embeds[flat] = self.cache[rows]
        return positions, embeds

    # ---------------------------------------------------------------- warmup
    def worst_case_features(self, num_tokens: int, max_tokens_per_item: int,
                            grid: tuple[int, int, int], patch_dim: int) -> list[Any]:
        """Dummy features of `num_tokens` encoder tokens in items of the worst-case
        `grid` (`max_tokens_per_item` tokens each; zero pixels, distinct hashes)."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        t, h, w = grid
        items = []
        for k in range(max(num_tokens // max_tokens_per_item, 1)):
            pixels = torch.zeros(t * h * w, patch_dim)
            items.append(MultiModalFeatureSpec("image", f"warmup-{k}",
                                               PlaceholderRange(0, max_tokens_per_item),
                                               {"pixel_values": pixels, "image_grid_thw": grid}))
        return items
