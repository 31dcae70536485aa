"""`EncoderCacheManager`: which images the vision encoder runs each step, and which
encoder outputs the runner keeps (torch-free; the scheduler's component).

An image's encoder output (one row per placeholder token) must exist in the
runner's encoder cache during every step that computes some of its
placeholders. With chunked prefill those are several steps, so the output is
computed once, when the first of its placeholders is scheduled, and kept until
the last one is computed:

    prompt      T T T [P P P P P P P P] T T          image at offset 3, length 8
    step 1      |chunk 0-4|                          encode the image (whole), cache it
    step 2                |chunk 5-9  |              read rows 2..6 from the cache
    step 3                        |chunk 10-13|      read row 7; the image is done:
    step 4                                           its entry becomes freeable

Two budgets, in encoder output tokens:
  * `max_num_encoder_input_tokens` per step: a step that would encode more
    schedules the request only up to the first image that does not fit;
  * `cache_size`: tokens of outputs held at once. Outputs nobody needs any more
    stay cached (an identical image of a later request, same `mm_hash`, reuses
    them) until their space is needed; then they are evicted, oldest first, and
    the runner is told to drop them (`SchedulerOutput.free_encoder_mm_hashes`).

An image larger than either budget can never run; the processor refuses such
images, and start-up never lowers a budget below one worst-case image.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


class EncoderCacheManager:
    """Encoder budget per step and the encoder cache's bookkeeping, keyed by mm_hash.

    Args:
        cache_size: encoder output tokens the runner's cache may hold (0 with
            the encoder budget 0: a text-only model, every request passes).
        max_num_encoder_input_tokens: encoder output tokens computed per step.

    Raises:
        ValueError: a size < 0.
    """

    def __init__(self, cache_size: int, max_num_encoder_input_tokens: int) -> None:
        if cache_size < 0 or max_num_encoder_input_tokens < 0:
            raise ValueError(f"encoder cache_size ({cache_size}) and "
                             f"max_num_encoder_input_tokens ({max_num_encoder_input_tokens}) "
                             "must be >= 0")
        self.cache_size = cache_size
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self.num_free_slots = cache_size  # tokens neither held nor freeable
        self.cached: dict[str, int] = {}  # mm_hash -> its tokens (held or freeable)
        self.refs: dict[str, set[str]] = {}  # mm_hash -> ids of requests that need it
        # Cached outputs no request needs, oldest first (evicted when space is needed).
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self._to_free: list[str] = []  # evicted since the last step_output()
        self._step_budget = max_num_encoder_input_tokens
        # req_id -> indices into its mm_features to encode this step.
        self._scheduled: dict[str, list[int]] = {}

    def fit(self, request: Request, num_computed: int, num_new: int) -> int:
        """How many of `num_new` tokens from `num_computed` the request may compute this
        step so that every image they touch has its encoder output: cached, or
        encoded this step within both budgets (those are recorded). Images whose
        placeholders are all computed are let go. Returns 0..num_new."""
        if not request.mm_features:
            return num_new
        req_id = request.request_id
        end = num_computed + num_new
        for index, feature in enumerate(request.mm_features):
            start, length, mm_hash = (feature.mm_position.offset, feature.mm_position.length,
                                      feature.identifier)
            if start + length <= num_computed:
                self._release(req_id, mm_hash)
                continue
            if start >= end:
                break
            if mm_hash in self.cached:
                self._hold(req_id, mm_hash)
                continue
            if length > self._step_budget or not self._make_room(length):
                return max(start - num_computed, 0)  # up to this image, not into it
            self._step_budget -= length
            self.num_free_slots -= length
            self.cached[mm_hash] = length
            self._hold(req_id, mm_hash)
            self._scheduled.setdefault(req_id, []).append(index)
        return num_new

    def free(self, request: Request) -> None:
        """The request is finished, preempted or not admitted after all: let go of its
        images (their outputs stay cached, freeable) and of its encodes this step."""
        if not request.mm_features:
            return
        for mm_hash in {f.identifier for f in request.mm_features}:
            self._release(request.request_id, mm_hash)
        for index in self._scheduled.pop(request.request_id, []):
            feature = request.mm_features[index]
            self._step_budget += feature.mm_position.length
            # Never computed: forget it. No other request holds it yet: one that
            # reuses it is scheduled after this one, and a step drops a request
            # (preemption, failed admission) only before those after it.
            self._evict(feature.identifier)

    def step_output(self) -> tuple[dict[str, list[int]], list[str]]:
        """(req_id -> indices of its mm_features to encode this step, mm_hashes the
        runner drops before it); starts the next step's budget."""
        scheduled, to_free = self._scheduled, self._to_free
        self._scheduled, self._to_free = {}, []
        self._step_budget = self.max_num_encoder_input_tokens
        return scheduled, to_free

    @property
    def num_cached_tokens(self) -> int:
        return self.cache_size - self.num_free_slots

    # ---- helpers ----

    def _hold(self, req_id: str, mm_hash: str) -> None:
        self.freeable.pop(mm_hash, None)
        self.refs.setdefault(mm_hash, set()).add(req_id)

    def _release(self, req_id: str, mm_hash: str) -> None:
        holders = self.refs.get(mm_hash)
        if holders is None or req_id not in holders:
            return
        holders.discard(req_id)
        if not holders:
            del self.refs[mm_hash]
            self.freeable[mm_hash] = self.cached[mm_hash]

    def _make_room(self, num_tokens: int) -> bool:
        """Evict freeable outputs (oldest first) until `num_tokens` slots are free."""
        if self.num_free_slots + sum(self.freeable.values()) < num_tokens:
            return False
        while self.num_free_slots < num_tokens:
            mm_hash, _ = self.freeable.popitem(last=False)
            self._evict(mm_hash)
            self._to_free.append(mm_hash)
        return True

    def _evict(self, mm_hash: str) -> None:
        self.freeable.pop(mm_hash, None)
        self.refs.pop(mm_hash, None)
        self.num_free_slots += self.cached.pop(mm_hash)
