"""`SleepState`: release and map again the weights' and the KV cache's pages (sleep mode).

    sleep(level)      level 1: weights copied to host, level 2: discarded; KV
                      contents discarded at both; every address is kept
    wake_up(tags)     fresh pages for "weights" and/or "kv_cache"; True when the
                      weights must be reloaded (`Worker.reload_weights`) after level 2
    sleeping_tags()   which parts are asleep now

A component of the `Worker` (its `sleep_state` field, with enable_sleep_mode):
it holds the weights' `WeightArena` (weight_arena.py, created at load time)
and the KV cache object, which releases and recommits itself
(`KVCacheBuffers.release` / `recommit`, the extensible cache only). The KV
connector, created later, is handed to each call: it deregisters before the
pages go and registers again once they are back.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

from vllm.device_allocator.vmm import VmmError
from vllm.exceptions import DeviceMemoryError
from vllm.logger import init_logger
from vllm.v1.worker.kv_cache_sizing import GiB

if TYPE_CHECKING:
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.kv_cache import KVCacheBuffers
    from vllm.v1.worker.kv_connector import WorkerKVConnector
    from vllm.v1.worker.memory import DeviceMemory
    from vllm.v1.worker.weight_arena import WeightArena

logger = init_logger(__name__)

TAGS = ("weights", "kv_cache")


class SleepState:
    """Sleep and wake of one rank's weights and KV cache (see the module docstring).

    Args:
        weight_arena: the parameters' reservation.
        kv_cache: the KV cache object (extensible: it can release its pages).
        memory: the worker's device-memory reader (figures for the log and errors).
        platform: the current platform (synchronize, empty its allocator's cache).
    """

    def __init__(self, weight_arena: WeightArena, kv_cache: KVCacheBuffers,
                 memory: DeviceMemory, platform: Platform) -> None:
        self.weight_arena = weight_arena
        self.kv_cache = kv_cache
        self.memory = memory
        self.platform = platform

    def sleep(self, level: int, connector: WorkerKVConnector | None) -> None:
        """Release weights' and KV cache's pages, keeping every address.

        Level 1 keeps a host copy of the weights; level 2 keeps nothing (reload
        after waking). KV contents are discarded at both. torch's cached
        (unused) memory is returned too.

        Raises:
            ValueError: a level other than 1 or 2.
            RuntimeError: the KV cache cannot release its memory (the classic cache).
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        start = time.monotonic()
        weights, kv = self.weight_arena.physical_bytes, self.kv_cache.committed_bytes
        self.memory.synchronize()
        if connector is not None and not self.kv_cache.is_released:
            connector.sleep()  # deregister before the pages go
        self.kv_cache.release()
        self.weight_arena.sleep(keep_on_host=level == 1)
        gc.collect()
        self.platform.empty_cache()
        logger.info(
            "Sleep level %d: released %.3f GiB of weights (%s) and %.3f GiB of KV cache "
            "in %.2f s; %.2f GiB free now",
            level, weights / GiB, "copied to host" if level == 1 else "discarded", kv / GiB,
            time.monotonic() - start, self.memory.free_bytes() / GiB,
        )

    def wake_up(self, tags: list[str] | None, connector: WorkerKVConnector | None) -> bool:
        """Map fresh pages for "weights" and/or "kv_cache" (both when tags is None).

        Returns:
            True when the woken weights are empty (after a level-2 sleep) and
            must be reloaded before generating; False otherwise. The same
            meaning at every layer up to `LLMEngine.wake_up`.

        A call that fails part-way (the weights mapped, the KV cache not) puts
        back to sleep what it woke, so the engine holds its asleep footprint
        again, as the error says (a level-1 host copy is taken again; level-2
        weights stay to be loaded: `WeightArena.needs_load`); the retry maps
        everything and still returns True when the weights must be loaded.

        Raises:
            ValueError: an unknown tag.
            DeviceMemoryError: the driver could not map the memory (names the
                bytes still to map and the bytes free); what could not be
                mapped stays asleep and a later call can retry.
        """
        tags = list(TAGS) if tags is None else list(dict.fromkeys(tags))
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights', 'kv_cache'")
        asleep = [t for t in tags if t in self.sleeping_tags()]
        needed = self._bytes_to_wake(asleep)
        start = time.monotonic()
        try:
            needs_reload = self.weight_arena.wake_up() if "weights" in tags else False
            if "kv_cache" in asleep:
                self.kv_cache.recommit()
                if connector is not None:
                    connector.wake_up(self.kv_cache)
        except VmmError as e:
            if "weights" in asleep:  # back to the footprint the caller is told it has
                self.weight_arena.sleep(keep_on_host=not self.weight_arena.needs_load)
                self.platform.empty_cache()
            raise DeviceMemoryError(
                f"wake_up could not map the {', '.join(asleep)} memory: it needs "
                f"{needed / GiB:.3f} GiB of device memory and {self.memory.free_bytes() / GiB:.3f}"
                f" GiB is free ({e}); the engine stays asleep, retry when memory is free",
                needed_bytes=needed, free_bytes=self.memory.free_bytes(),
            ) from e
        if asleep:
            logger.info("Woke %s: mapped %.3f GiB in %.2f s%s", " and ".join(asleep),
                        needed / GiB, time.monotonic() - start,
                        "; the weights must be reloaded" if needs_reload else "")
        return needs_reload

    def _bytes_to_wake(self, tags: list[str]) -> int:
        """Bytes a wake of these (sleeping) parts maps: what they held when they slept."""
        parts = {"weights": self.weight_arena, "kv_cache": self.kv_cache}
        return sum(parts[t].released_bytes for t in tags)

    def sleeping_tags(self) -> list[str]:
        """Which of "weights" / "kv_cache" are asleep now."""
        tags = []
        if self.weight_arena.is_sleeping:
            tags.append("weights")
        if self.kv_cache.is_released:
            tags.append("kv_cache")
        return tags
