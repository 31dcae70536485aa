"""The engine core's side of the elastic KV cache: carry out the policy on every rank.

Between steps (and at every idle poll) `ElasticKVController.adjust()` asks the
policy (`vllm/v1/core/elastic.py`) what to do and does it in the one order
that keeps every block id valid:

    grow    workers commit first (each as far as its free memory allows; the
            ranks then agree on the smallest count), then the block pool adopts it
    shrink  the block pool drops the free tail blocks first (evicting any
            prefix-cache entries there), then the workers release the pages

Counters (`num_grows`, `num_shrinks`) and the committed bytes reach /metrics
through `KVCacheMemory`.
"""

from __future__ import annotations

import os

from vllm.logger import init_logger
from vllm.v1.core.elastic import DEFAULT_SHRINK_DELAY_S, ElasticKVPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.executor import Executor

logger = init_logger(__name__)

SHRINK_DELAY_ENV = "VLLM_ELASTIC_KV_SHRINK_DELAY_S"


def shrink_delay_s() -> float:
    """`VLLM_ELASTIC_KV_SHRINK_DELAY_S` (seconds >= 0), default 10.

    Raises:
        ValueError: not a number >= 0 (names the variable).
    """
    raw = os.environ.get(SHRINK_DELAY_ENV, "").strip()
    if not raw:
        return DEFAULT_SHRINK_DELAY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{SHRINK_DELAY_ENV}={raw!r} must be a number of seconds >= 0")
    return value


class ElasticKVController:
    """Grows and shrinks the KV cache of every rank and the scheduler's block pool together.

    Args:
        executor: runs `grow_kv_cache` / `shrink_kv_cache` on every rank.
        scheduler: owns the block pool.
        bounds: the workers' `ElasticBounds` (floor, limit, max_limit, chunk).
    """

    def __init__(self, executor: Executor, scheduler: Scheduler, bounds) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.max_limit = bounds.max_limit
        self.policy = ElasticKVPolicy(
            committed=scheduler.num_blocks, floor=bounds.floor, limit=bounds.limit,
            chunk=bounds.chunk, shrink_delay_s=shrink_delay_s(),
        )
        scheduler.max_num_blocks = bounds.limit

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def adjust(self, allow_shrink: bool = True) -> bool:
        """Apply the policy once; True when the committed block count changed.

        Args:
            allow_shrink: False while a launched step may still write KV (async
                scheduling): a block freed after that step was scheduled can be
                one it writes, so its pages stay until no step is in flight.
                Growing is always safe (no step references new blocks).
        """
        pool = self.pool
        decision = self.policy.decide(
            pool.get_num_free_blocks(), pool.num_free_tail_blocks(),
            self.scheduler.kv_blocks_wanted(),
        )
        if decision is None or (decision.action == "shrink" and not allow_shrink):
            pool.prefer_below = self.policy.shrink_target()
            return False
        if decision.action == "grow":
            return self.grow(decision.num_blocks)
        return self.shrink(decision.num_blocks)

    def grow(self, num_blocks: int) -> bool:
        before = self.scheduler.num_blocks
        reached = min(self.executor.collective_rpc("grow_kv_cache", args=(num_blocks,)))
        reached = min(self.executor.collective_rpc("shrink_kv_cache", args=(reached,)))
        if reached <= before:
            return False
        self.scheduler.resize_kv_cache(reached)
        self.policy.adopt(reached)
        return True

    def shrink(self, num_blocks: int) -> bool:
        before = self.scheduler.num_blocks
        num_blocks = max(num_blocks, self.policy.floor, before - self.pool.num_free_tail_blocks())
        if num_blocks >= before:
            return False
        self.scheduler.resize_kv_cache(num_blocks)
        kept = max(self.executor.collective_rpc("shrink_kv_cache", args=(num_blocks,)))
        self.policy.adopt(kept)
        return True

    def set_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling in bytes (None: the start-up limit); returns the limit in blocks.

        Blocks above it are released as soon as they are free (the next adjust).
        """
        bounds = self.executor.collective_rpc("set_kv_cache_limit", args=(limit_bytes,))
        limit = min(b.limit for b in bounds)
        self.policy.set_limit(limit)
        self.scheduler.max_num_blocks = limit
        self.adjust()
        return limit

    def shrink_to_floor(self) -> None:
        """Before sleep (nothing is held then): back to the floor."""
        self.shrink(self.policy.floor)
        self.policy.boundaries = [self.scheduler.num_blocks]

    def regrow(self, num_blocks: int) -> None:
        """After wake: grow back towards `num_blocks` as far as memory allows now."""
        self.grow(num_blocks)
