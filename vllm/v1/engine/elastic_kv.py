"""The engine core's side of the elastic KV cache: carry the policy out, share the device.

`ElasticKVController` is a component of the `EngineCore` (its `elastic_kv`
field, with `--enable-elastic-kv-cache`). Between steps, and at every idle
poll of the engine loop, `adjust()`:

    1. asks the scheduler's policy (`ElasticKVPolicy.target`) what block count
       it wants, from the requests' demand (`blocks_wanted`);
    2. grows: each worker commits on a helper thread, as far as free memory
       allows (`Worker.grow_kv_cache_ahead`); once every rank's growth ended,
       at a step boundary, the ranks agree on the smallest count and the
       scheduler adopts it; no step waits for the driver. What the requests
       still lack with no growth under way is published as a demand to the
       device's other elastic engines (`DeviceSharing.want`);
       shrinks (the idle timer): as a release for a peer (3.), without
       preempting;
    3. answers a peer's demand (also while it lacks memory itself): releases
       whole pieces at once (`ElasticKVPolicy.reclaim_target`), not after the
       idle timer, keeping its own low-water mark and demand free; the blocks
       its running requests hold above the piece boundary are *moved* below
       it (a device copy, `Worker.move_kv_blocks`; the requests keep running).
       When that is not enough and this engine holds more than the asker and
       its fair share (`DeviceSharing.answer`'s `keep`), it also preempts, by
       recompute, the newest running requests worth it (`worth_preempting_for_peer`:
       their decode to go outweighs their recompute) until the blocks in use
       fit below a lower boundary (`ElasticKVPolicy.preempt_target`,
       `Scheduler.preempt_for_shrink`), moves the rest down and releases:
       an engine that got the device first no longer keeps it while its
       queue refills it (issue #49's engine B waited 24 s for engine A's
       1,024-token decodes to end; before the move, releasing 1,984 blocks
       preempted 99 of 113 requests, whose blocks lay all over the tail);
    4. publishes committed / in-use / reclaimable / limit to the registry
       (`vllm kv-top`, /metrics), at most every `PUBLISH_S`.

With async scheduling a step is in flight while this runs: a release leaves
the scheduler's pool at once and reaches the workers at the next call; the
block copies are enqueued on the device's stream after the step in flight
(which may still write the sources) and before the next; the workers wait
for the device before they unmap.
Nothing here runs inside a step; a release takes the driver calls' time
(~0.1-0.4 ms per 1-8 GiB on the H200, docs/elastic_kv_cache.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.device_registry import RegistryError
from vllm.v1.core.elastic import blocks_wanted, worth_preempting_for_peer
from vllm.v1.core.elastic_sharing import DeviceShare, DeviceSharing
from vllm.v1.worker.gpu_worker import Worker

if TYPE_CHECKING:
    from vllm.v1.core.sched.preemption import MayPreempt
    from vllm.v1.core.sched.scheduler import Scheduler

logger = init_logger(__name__)

# How often the registry's figures of this engine are refreshed (a demand and
# an answer are written at once, whatever this says). Reading what is reclaimable
# walks the pool's free tail: not every step.
PUBLISH_S = 0.25
# After releasing blocks for a peer, this engine does not grow for this long, so
# the asker's next growth (at its next step) finds the memory and this engine's
# own demand (its preempted requests) does not take it back first.
HOLD_AFTER_GIVING_S = 1.0


class ElasticKVController:
    """Grows, shrinks and shares one engine's elastic KV cache between steps.

    Args:
        scheduler: the engine's scheduler (its `elastic` policy is set).
        collective_rpc: the executor's `collective_rpc` (every rank answers).
        share_as: the name this engine has in its device's registry
            (`registry_name`); None: no registry (`VLLM_ELASTIC_KV_SHARING=0`).
        clock: seconds, monotonic.

    A registry file that cannot be joined (OSError: another version's, foreign
    bytes, a directory that does not exist or cannot be written) leaves sharing
    off with one warning whose hint fits the cause (`RegistryError.hint`).

    Raises:
        RuntimeError: the device's registry has no free slot (see `DeviceSharing`).
    """

    def __init__(self, scheduler: Scheduler, collective_rpc: Callable[..., list[Any]],
                 share_as: str | None, clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.policy = scheduler.elastic
        self.run = collective_rpc
        self.clock = clock
        self.sharing: DeviceSharing | None = None
        self.block_bytes = 0  # summed over the ranks
        # Blocks: committed, in_use, reclaimable, floor, limit, as last published.
        self.figures: dict[str, int] = {}
        self.figures_version = 0
        self._published_at = float("-inf")
        self._release_pending: int | None = None  # blocks the workers shrink to next call
        self._gave_at = float("-inf")  # when this engine last released blocks for a peer
        self.asleep = False  # between before_sleep and after_wake: publishes no KV held
        devices: dict[str, int] = {}
        for key, block_bytes in self.run(Worker.kv_cache_device):
            devices[key] = devices.get(key, 0) + block_bytes
        self.block_bytes = sum(devices.values())
        if share_as is not None:
            try:
                self.sharing = DeviceSharing([DeviceShare(k, b) for k, b in devices.items()],
                                             share_as, clock=clock)
            except OSError as e:  # a missing directory, a foreign file: serve anyway
                logger.warning("Elastic KV cache: running without the device registry (%s): "
                               "no reclaim on a peer's demand, idle release on the timer "
                               "only; %s", e, e.hint if isinstance(e, RegistryError)
                               else "set VLLM_KV_REGISTRY_DIR to another directory")
        self.publish(force=True)

    @property
    def num_reclaims(self) -> int:
        """Peers' demands this engine answered by releasing blocks."""
        return 0 if self.sharing is None else self.sharing.num_reclaims

    # ----------------------------------------------------------- the step
    def adjust(self, step_in_flight: bool = False) -> bool:
        """Grow, shrink or release for a peer as needed now; True when the count changed.

        Args:
            step_in_flight: a step is on the device (async scheduling): what is
                released leaves the scheduler's pool now and reaches the workers
                at the next call, after it.
        """
        self._release_now()
        s, policy = self.scheduler, self.policy
        kv = s.kv_cache_manager
        wanted = blocks_wanted(s.waiting, s.running, s.block_size)
        target = policy.target(kv, wanted)
        changed, lacking = False, 0
        if target is not None and target > s.num_blocks:
            # What this engine just gave is the asker's to take (HOLD_AFTER_GIVING_S): no
            # growth, and no demand of its own meanwhile.
            if self.clock() - self._gave_at >= HOLD_AFTER_GIVING_S:
                changed, in_flight = self.grow_ahead(target)
                # What the requests still lack once no growth of ours is under way: ask
                # the device's other engines for it.
                lacking = 0 if in_flight else policy.shortfall(kv, wanted)
        elif target is not None:
            changed = self.release_to(target, release_now=not step_in_flight)
        if self.sharing is not None:
            if changed:  # a peer's answer reads this engine's committed bytes
                self.publish(force=True)
            self.sharing.want(lacking)
            # Also while lacking: a peer that holds less is answered down to the fair share.
            changed = self._answer_peers(wanted, step_in_flight) or changed
        self.publish(force=changed)
        return changed

    def _answer_peers(self, wanted: int, step_in_flight: bool) -> bool:
        s, policy = self.scheduler, self.policy
        kv, planned = s.kv_cache_manager, []

        def release_for(blocks: int, keep: int | None) -> int:
            target = policy.reclaim_target(kv, blocks, wanted)
            freed = 0 if target is None else s.num_blocks - target
            deeper = None if keep is None or freed >= blocks else self._worth_preempting(
                policy.preempt_target(blocks, keep))
            # Preempt when that releases more than moving blocks alone does: at least one
            # more piece, even if less than all the peer lacks (the fair share may stop it
            # sooner; the peer renews what it still lacks).
            if deeper is not None and s.num_blocks - deeper > freed:
                target, freed = deeper, s.num_blocks - deeper
            planned.append(target)
            return freed

        if not self.sharing.answer(release_for) or planned[-1] is None:
            return False
        self._gave_at = self.clock()
        return self.release_to(planned[-1], release_now=not step_in_flight,
                               may_preempt=worth_preempting_for_peer)

    def _worth_preempting(self, target: int | None) -> int | None:
        """`target`, or the lowest boundary above it that preempting only the requests
        worth it for a peer reaches (`worth_preempting_for_peer`; the scheduler says what
        stays in use, `Scheduler.blocks_in_use_after_preempting`); None: no such boundary."""
        if target is None:
            return None
        in_use = self.scheduler.blocks_in_use_after_preempting(
            self.policy.in_use_budget(target), worth_preempting_for_peer)
        return self.policy.lowest_boundary_fitting(in_use, target)

    def release_to(self, num_blocks: int, release_now: bool = True,
                   may_preempt: MayPreempt = None) -> bool:
        """Shrink to `num_blocks` (a boundary) whatever the requests hold above it.

        Running requests `may_preempt` allows (None: any) are preempted, newest
        first, only as far as the blocks in use must fit below it
        (`ElasticKVPolicy.in_use_budget`, `Scheduler.preempt_for_shrink`); the blocks
        in use above it are moved below it (`KVCacheManager.move_blocks_below`,
        then each worker copies them on the device after the step in flight,
        `Worker.move_kv_blocks`). A block that cannot move (held by a request
        whose KV a connector loads or sends) keeps the shrink above it.
        `release_now`: False while a step is in flight (async scheduling): the
        pages go at the next call, after it.
        """
        s, policy, kv = self.scheduler, self.policy, self.scheduler.kv_cache_manager
        preempted = s.preempt_for_shrink(policy.in_use_budget(num_blocks), may_preempt)
        src, dst = kv.move_blocks_below(num_blocks, [r.request_id for r in s.running])
        if src:
            self.run(Worker.move_kv_blocks, args=(src, dst))
        target = policy.boundary_at_or_above(max(num_blocks, policy.lowest_now(kv)))
        if src or preempted:
            logger.info("Elastic KV cache: moved %d blocks and preempted %d requests to release "
                        "blocks %d..", len(src), preempted, target)
        return self.shrink(target, release_now=release_now) or bool(src)

    def grow(self, num_blocks: int) -> bool:
        """The workers commit up to `num_blocks` now, then the scheduler adopts what they
        reached (wake; `grow_ahead` while serving)."""
        return self._adopt_grown(self.run(Worker.grow_kv_cache, args=(num_blocks,)))

    def grow_ahead(self, num_blocks: int) -> tuple[bool, bool]:
        """Have each worker commit up to `num_blocks` on a helper thread; adopt a growth
        that ended on every rank.

        Returns:
            (the count changed, a growth is still in flight on some rank).
        """
        replies = self.run(Worker.grow_kv_cache_ahead, args=(num_blocks,))
        if any(in_flight for _, in_flight, _ in replies):
            return False, True
        return self._adopt_grown([(reached, ends) for reached, _, ends in replies]), False

    def _adopt_grown(self, per_rank: list[tuple[int, list[int]]]) -> bool:
        """Adopt the smallest count the ranks reached; the allocation ends every rank has
        become the policy's boundaries (a shrink to one returns memory on every rank)."""
        reached = min(r for r, _ in per_rank)
        if max(r for r, _ in per_rank) > reached:
            # A rank that reached more gives the excess back: every rank holds the same count.
            reached = min(self.run(Worker.shrink_kv_cache, args=(reached,)))
        if reached <= self.scheduler.num_blocks:
            return False
        ends = set.intersection(*(set(e) for _, e in per_rank))
        self.scheduler.resize_kv_cache(reached, sorted(e for e in ends if e < reached))
        return True

    def shrink(self, num_blocks: int, release_now: bool = True) -> bool:
        """Drop the free tail from the scheduler's pool, then release its pages on the workers
        (now, or at the next `adjust` when a step in flight may still write them)."""
        if num_blocks >= self.scheduler.num_blocks:
            return False
        self.scheduler.resize_kv_cache(num_blocks)  # only free tail blocks go
        self._release_pending = num_blocks
        if release_now:
            self._release_now()
        return True

    def _release_now(self) -> None:
        if self._release_pending is not None:
            self.run(Worker.shrink_kv_cache, args=(self._release_pending,))
            self._release_pending = None

    def publish(self, force: bool = False) -> None:
        """Refresh this engine's figures (what `/metrics` and the device registry show),
        at most every `PUBLISH_S` unless forced; `figures_version` counts the changes."""
        now = self.clock()
        if not force and now - self._published_at < PUBLISH_S:
            return
        self._published_at = now
        s, policy = self.scheduler, self.policy
        kv = s.kv_cache_manager
        committed = s.num_blocks
        wanted = blocks_wanted(s.waiting, s.running, s.block_size)
        keep = policy.reclaim_target(kv, committed, wanted)  # all that can go now
        figures = dict(committed=committed, in_use=kv.num_blocks_in_use(),
                       reclaimable=0 if keep is None else committed - keep,
                       floor=policy.floor, limit=policy.limit)
        if self.asleep:  # the workers hold no KV pages: as /metrics says, nothing committed
            figures.update(committed=0, in_use=0, reclaimable=0)
        if figures == self.figures:
            return
        self.figures = figures
        self.figures_version += 1
        if self.sharing is not None:
            self.sharing.publish(**figures)

    # ------------------------------------------------------ limit, sleep
    def set_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling in blocks' bytes summed over the ranks (the unit of /metrics,
        so a figure read there comes back as the same count, as is one read in `vllm
        kv-top`; None: the start-up limit), rounded down to whole blocks; returns it in
        blocks.

        Raises:
            ValueError: a limit that is negative or not an int (1.5, True, "8GiB").
        """
        limit_blocks = None
        if limit_bytes is not None:
            if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool):
                raise ValueError("the KV cache limit must be an int number of bytes (or "
                                 f"None), got {limit_bytes!r}")
            if limit_bytes < 0:
                raise ValueError(f"the KV cache limit must be >= 0 bytes, got {limit_bytes}")
            limit_blocks = limit_bytes // self.block_bytes
        bounds = self.run(Worker.set_kv_cache_limit, args=(limit_blocks,))
        limit = min(b.limit for b in bounds)
        self.policy.set_limit(limit)
        self.adjust()
        self.publish(force=True)
        return limit

    def before_sleep(self) -> int:
        """Shrink to the floor (the pool is empty by now); returns the count to wake back to."""
        self._release_now()
        before = self.scheduler.num_blocks
        self.shrink(self.policy.lowest_now(self.scheduler.kv_cache_manager))
        self.asleep = True  # the caller puts the workers to sleep next
        if self.sharing is not None:
            self.sharing.want(0)  # a sleeping engine asks no peer for memory
        self.publish(force=True)
        return before

    def kv_woken(self) -> None:
        """The workers mapped the KV cache's floor back (the weights may still sleep):
        publish it again."""
        self.asleep = False
        self.publish(force=True)

    def after_wake(self, num_blocks: int) -> None:
        """Grow back towards the pre-sleep count, as far as memory is free now."""
        self.asleep = False
        self._release_now()
        self.grow(num_blocks)
        self.publish(force=True)

    def close(self) -> None:
        """Leave the device registry (nothing of this engine stays there)."""
        self._release_pending = None  # the workers release everything as they stop
        if self.sharing is not None:
            self.sharing.close()
            self.sharing = None


def registry_name(served_model_name: str, model: str) -> str:
    """An engine's name in its device's registry (`vllm kv-top`'s MODEL column).

    The served model name (`--served-model-name`, so two engines of one model
    tell apart); left unset it is the model's path, shown as the path's last
    component (a GGUF file's name without ".gguf").
    """
    if served_model_name != model or os.sep not in model:
        return served_model_name
    name = Path(model.rstrip(os.sep)).name
    return name[:-len(".gguf")] if name.endswith(".gguf") else name
