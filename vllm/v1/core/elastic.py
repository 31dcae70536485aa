"""The elastic KV cache's policy: when to commit more blocks and when to return some.

Torch-free; a component of the `Scheduler` (its `elastic` field): between
steps (and at every idle poll) the engine core asks the policy what count it
wants (`ElasticKVPolicy.target`), carries it out on the workers
(`Worker.grow_kv_cache` / `shrink_kv_cache`) and has the scheduler adopt it
(`Scheduler.resize_kv_cache`, which calls `adopt`). Numbers are block counts
counting the null block.

    grow    when the free blocks run below a low-water mark (a quarter chunk
            but at most half the floor, or what waiting requests need): to
            committed + max(chunk, need), at most the limit. The worker may
            reach less (memory is free only now, less a headroom); the
            scheduler then queues or preempts as it does whenever the cache
            is full.
    points  a growth is committed as one driver allocation per piece (an
            eighth of a chunk; the worker splits it, `growth_points` in
            vllm/v1/worker/elastic_kv_cache.py, and reports where its pieces
            end: the growth's inner boundaries), so memory can go back a piece
            at a time (what a peer's demand takes)
    shrink  when, for `shrink_delay_s`, the blocks in use would have fit below b
            with the low-water mark (or the requests' demand) still free: back
            to b, the highest boundary at least a chunk below what is committed
            (else the lowest one), so the idle timer returns about a chunk each
            time. The blocks in use above b are moved below it first (the
            engine core's `ElasticKVController.release_to`). Also when a runtime
            limit is set below what is committed (no delay; the low-water mark
            only).
    prefer  while a shrink is possible, allocation prefers ids below b
            (`BlockPool.prefer_blocks_below`), so fewer blocks have to move.

Sources: kvcached (elastic KV memory for co-located LLMs, github.com/ovg-project/kvcached)
shrinks idle tail pages the same way; the thresholds here are ours.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

DEFAULT_SHRINK_DELAY_S = 10.0
# A prefill token costs far less device time than a decode step (the whole prompt is
# one chunked pass), so a request is worth recomputing for a peer while its tokens to
# go are at least this share of its computed tokens (`worth_preempting_for_peer`;
# chosen between the two loads it separates: 0.04 prefill-heavy, >= 0.3 decode-heavy
# until a request's last ~quarter).
PEER_PREEMPT_RECOMPUTE_SHARE = 0.25


def blocks_wanted(waiting: Iterable[Request], running: Iterable[Request], block_size: int) -> int:
    """Blocks the requests ask for next (the policy's demand signal).

    Every waiting request's uncomputed tokens (prefix-cache hits not counted)
    plus one block per running request (a decode crosses into a new block at
    most once per step).
    """
    waiting_blocks = sum(-(-(r.num_tokens - r.num_computed_tokens) // block_size)
                         for r in waiting)
    return waiting_blocks + sum(1 for _ in running)


def worth_preempting_for_peer(request: Request) -> bool:
    """Whether to preempt `request` (by recompute) so that a peer engine gets its blocks.

    Yes while the decode it has left (max_tokens less its output so far; no
    max_tokens: yes) is at least a `PEER_PREEMPT_RECOMPUTE_SHARE` of what it
    would recompute (its computed tokens, prefilled again). A request near its
    end, or with a long prompt and a short reply, keeps running and frees its
    blocks itself soon. Measured (H100, 2026-12-07, two 8B-shape engines, the
    prefill-heavy Poisson load: ~2,900-token prompts, 128-token replies):
    without this rule, answering the peer preempted 48 requests (static: 4),
    all of them recomputed, and TTFT p99 lost 1.54x to the static split;
    `benchmarks/elastic_sim.py` reproduces it and shows the rule keeping the
    decode-heavy load's gains (its requests have ~450 prompt tokens and up to
    1,024 to go).
    """
    if request.max_tokens is None:
        return True
    to_go = request.max_tokens - request.num_output_tokens
    return to_go >= PEER_PREEMPT_RECOMPUTE_SHARE * request.num_computed_tokens


@dataclass(frozen=True)
class ElasticDecision:
    """What to do now: grow to `num_blocks`, shrink to it, or nothing (None)."""

    action: str  # "grow" | "shrink"
    num_blocks: int


class ElasticKVPolicy:
    """Decides grow/shrink targets from the block pool's state.

    Args:
        committed: blocks committed at start-up (the floor, normally).
        floor: never shrink below.
        limit: never grow above (changed by `set_limit`).
        chunk: the least one growth adds.
        shrink_delay_s: how long the tail must stay free before it goes.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self, committed: int, floor: int, limit: int, chunk: int,
        shrink_delay_s: float = DEFAULT_SHRINK_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= floor <= committed <= max(limit, committed) or chunk < 1:
            raise ValueError(
                f"need 1 <= floor ({floor}) <= committed ({committed}) and chunk ({chunk}) >= 1"
            )
        self.floor, self.limit, self.chunk = floor, limit, chunk
        self.shrink_delay_s = shrink_delay_s
        self.clock = clock
        self.boundaries = [committed]  # committed counts after each growth, ascending
        self._spare_since: float | None = None
        self.num_grows = 0
        self.num_shrinks = 0

    @property
    def low_water(self) -> int:
        """Free blocks below which the cache grows: a quarter chunk, at most half the floor.

        Capped by the floor so an idle engine stays at its floor: on the H200 the
        8B shape's floor was 288 blocks and its chunk 7,820, so a quarter chunk
        made every engine grow 15.3 GiB at start-up with nothing to serve and
        never shrink back (2026-12-02).
        """
        return max(min(self.chunk // 4, self.floor // 2), 1)

    @property
    def committed(self) -> int:
        return self.boundaries[-1]

    def shrink_target(self) -> int | None:
        """The count the idle timer would go back to, if any: the highest boundary at least
        a chunk below what is committed, else the lowest one (over a limit: the highest
        boundary within it)."""
        below = [b for b in self.boundaries[:-1] if b <= self.limit]
        if self.committed > self.limit:
            return max(below, default=self.floor)
        far = [b for b in below if self.committed - b >= self.chunk]
        return max(far) if far else (below[0] if below else None)

    def decide(self, num_free: int, blocks_wanted: int) -> ElasticDecision | None:
        """What to do now.

        Args:
            num_free: free blocks in the pool (cached ones included).
            blocks_wanted: blocks the waiting and running requests ask for next.
        """
        committed = self.committed
        need = max(self.low_water, blocks_wanted)
        if num_free < need and committed < self.limit:
            self._spare_since = None
            target = min(self.limit, committed + max(self.chunk, need - num_free))
            return ElasticDecision("grow", target)
        target = self.shrink_target()
        if target is None:
            self._spare_since = None
            return None
        over_limit = committed > self.limit
        # Where the blocks in use lie does not matter (they move), how many do.
        if num_free - (committed - target) < (self.low_water if over_limit else need):
            self._spare_since = None
            return None
        now = self.clock()
        if self._spare_since is None:
            self._spare_since = now
        if over_limit or now - self._spare_since >= self.shrink_delay_s:
            return ElasticDecision("shrink", target)
        return None

    def target(self, kv: KVCacheManager, blocks_wanted: int) -> int | None:
        """The block count to resize to now, or None, from the KV cache manager's pool.

        Called before every step. A shrink goes back to a growth's boundary
        (whole driver allocations are released); the blocks in use above it
        are moved below it by the caller (`ElasticKVController.release_to`).
        While a shrink is possible, allocation prefers the ids below it, so
        fewer blocks have to move.
        """
        decision = self.decide(kv.get_num_free_blocks(), blocks_wanted)
        if decision is None:
            kv.prefer_blocks_below(self.shrink_target())
            return None
        return decision.num_blocks

    def lowest_now(self, kv: KVCacheManager) -> int:
        """The fewest blocks the pool can shrink to without moving a block: the floor, or
        more while tail blocks are in use."""
        return max(self.floor, kv.num_blocks - kv.num_free_tail_blocks())

    def shortfall(self, kv: KVCacheManager, blocks_wanted: int) -> int:
        """Blocks the requests ask for beyond the free ones (with the low-water mark),
        within the limit: what an engine that cannot grow asks its peers for."""
        need = max(self.low_water, blocks_wanted) - kv.get_num_free_blocks()
        return max(0, min(need, self.limit - self.committed))

    def reclaim_target(self, kv: KVCacheManager, blocks: int, blocks_wanted: int) -> int | None:
        """The count to shrink to now so that a peer gets `blocks` blocks' worth.

        Reclaim on demand (a peer on the device cannot grow): no delay, whole
        pieces only (a boundary), no request preempted, and the engine keeps
        max(low-water mark, what its own requests ask for) free. Blocks in use
        above the boundary are moved below it first (`KVCacheManager.move_blocks_below`,
        a device copy), so what counts is how many are in use, not where. The
        boundary that releases `blocks` or more and keeps the most, else the
        lowest that can go. None: nothing can go now.
        """
        keep_free = max(self.low_water, blocks_wanted)
        in_use = kv.num_blocks_in_use()
        feasible = [b for b in self.boundaries[:-1]
                    if b >= self.floor and b - 1 - in_use >= keep_free]
        if not feasible:
            return None
        enough = [b for b in feasible if self.committed - b >= blocks]
        return max(enough) if enough else min(feasible)

    def in_use_budget(self, num_blocks: int) -> int:
        """The most blocks requests may hold in a pool of `num_blocks` just released to:
        all but the null block and the low-water mark (what `Scheduler.preempt_for_shrink`
        preempts down to)."""
        return max(0, num_blocks - 1 - self.low_water)

    def preempt_target(self, blocks: int, keep: int) -> int | None:
        """The count to shrink to, preempting the requests above it, so a peer gets `blocks`.

        For a peer that holds less than this engine (`DeviceSharing.answer` sets
        `keep`, this engine's fair share: never below the peer): the boundary at
        or above max(keep, floor) that releases `blocks` or more and keeps the
        most, else the lowest such boundary. None: no boundary below what is
        committed. The caller preempts running requests, newest first, until
        the blocks in use fit below it (`in_use_budget`,
        `Scheduler.preempt_for_shrink`), as vLLM preempts by recompute when
        blocks run out, and moves the rest below it.
        """
        candidates = [b for b in self.boundaries[:-1] if b >= max(keep, self.floor)]
        if not candidates:
            return None
        enough = [b for b in candidates if self.committed - b >= blocks]
        return max(enough) if enough else min(candidates)

    def lowest_boundary_fitting(self, in_use: int, at_least: int) -> int | None:
        """The lowest boundary >= `at_least` whose pool holds `in_use` blocks in use
        (`in_use_budget`), below what is committed; None: no such boundary."""
        return min((b for b in self.boundaries[:-1]
                    if b >= at_least and self.in_use_budget(b) >= in_use), default=None)

    def boundary_at_or_above(self, num_blocks: int) -> int:
        """The lowest boundary at or above `num_blocks` (what is committed, if none)."""
        return min((b for b in self.boundaries if b >= num_blocks), default=self.committed)

    def adopt(self, num_blocks: int, boundaries: Iterable[int] = ()) -> None:
        """Record the count the workers reached (after a grow or a shrink).

        Args:
            boundaries: a growth's inner allocation ends (where the workers
                split it, `growth_points`): counts a shrink may go back to.
        """
        self._spare_since = None
        if num_blocks > self.committed:
            self.boundaries += sorted(b for b in boundaries if self.committed < b < num_blocks)
            self.boundaries.append(num_blocks)
            self.num_grows += 1
        elif num_blocks < self.committed:
            while len(self.boundaries) > 1 and self.boundaries[-1] > num_blocks:
                self.boundaries.pop()
            if self.boundaries[-1] < num_blocks:
                self.boundaries.append(num_blocks)
            self.num_shrinks += 1

    def set_limit(self, limit: int) -> None:
        self.limit = limit
