"""`KVCacheSetup`: one rank's KV cache at start-up, as the plan says: allocate, then size.

    Worker.initialize_kv_cache
      allocate(specs, profile)    classic: the final size from the profile, all of it
                                  extensible: reserve the capacity, commit the warmup blocks
    Worker.compile_or_warm_up_model (after warmup and graph capture)
      size_after_warmup(cache)    what is free now -> the final block count
                                  (kv_cache_sizing.final_num_blocks), agreed across ranks
      log_final_size(...)         one INFO line with every figure

A component of the `Worker` (its `kv_setup` field) that decides nothing
itself: the numbers come from `kv_cache_sizing.py`, the path and the
utilization from the engine's `StartupPlan`, the agreement across ranks from
the worker's `agree_num_blocks`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from vllm.config import VllmConfig
from vllm.config.startup import StartupPlan
from vllm.logger import init_logger
from vllm.platforms.interface import Platform
from vllm.v1.kv_cache_interface import KVCacheSpec, get_kv_cache_config
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker import ranks
from vllm.v1.worker.kv_cache import ClassicKVCacheBuffers, ExtensibleKVCacheBuffers, KVCacheBuffers
from vllm.v1.worker.memory import DeviceMemory

logger = init_logger(__name__)
GiB = sizing.GiB


class KVCacheSetup:
    """Allocates and sizes one rank's KV cache at start-up (see the module docstring).

    Args:
        config: the engine configuration (block size, explicit bytes, limits).
        plan: the start-up plan (KV cache path, utilization, elastic).
        platform, device, memory: where the cache lives and how memory is read.
        world_size: ranks of the engine (sizing errors are exchanged between them).
        agree: takes this rank's block count, returns the one every rank uses.
    """

    def __init__(
        self, config: VllmConfig, plan: StartupPlan, platform: Platform, device: torch.device,
        memory: DeviceMemory, world_size: int, agree: Callable[[int], int],
    ) -> None:
        self.cache = config.cache_config
        self.kv_transfer = config.kv_transfer_config
        self.plan = plan
        self.platform = platform
        self.device = device
        self.memory = memory
        self.world_size = world_size
        self.agree = agree
        self.commits_lazily = False  # pages resident once written (the CPU's static cache)
        self.max_useful_blocks = sizing.max_useful_blocks(
            config.scheduler_config.max_num_seqs, config.model_config.max_model_len,
            self.cache.block_size)

    def allocate(self, specs: dict[str, KVCacheSpec],
                 profile: sizing.MemoryProfile) -> KVCacheBuffers:
        """The one place that picks the KV cache object; everything else asks it.

        Raises:
            ValueError: `kv_cache_memory_bytes` below two blocks of the rank with the
                largest blocks, on every rank alike (a usage error, exit 2). Ranks whose
                KV heads split unevenly (3 heads at TP=2) have blocks of different bytes,
                so each checks against all ranks' blocks (`ranks.each_rank`); checked
                against its own, only rank 0 raised and the start-up failed with exit 1
                and that worker's traceback. Rejected: `ranks.on_every_rank` around each
                rank's own check, whose error names one minimum per failing rank.
        """
        explicit = self.cache.kv_cache_memory_bytes
        if explicit is not None:  # the same config on every rank: all gather, or none
            block_bytes = get_kv_cache_config(specs, 1).bytes_per_block
            sizing.check_explicit_bytes(explicit, ranks.each_rank(self.world_size, block_bytes))
        if self.plan.extensible_kv_cache:
            return self._reserve_extensible(specs)
        return self._allocate_classic(specs, profile)

    def _allocate_classic(self, specs: dict[str, KVCacheSpec],
                          profile: sizing.MemoryProfile) -> KVCacheBuffers:
        layout = get_kv_cache_config(specs, 1)
        size = ranks.on_every_rank(self.world_size,
                                   lambda: self._classic_size(profile, layout.bytes_per_block))
        num_blocks = self.agree(size.num_blocks)
        kv_cache = ClassicKVCacheBuffers(get_kv_cache_config(specs, num_blocks), self.device)
        kv_cache.allocate(num_blocks)
        logger.info(
            "KV cache (classic): %.2f GiB (budget %.2f GiB, limited by %s), %d blocks, "
            "%d tokens of capacity",
            kv_cache.config.size_bytes / GiB, size.bytes.budget_bytes / GiB,
            size.bytes.limited_by, num_blocks, (num_blocks - 1) * self.cache.block_size,
        )
        return kv_cache

    def _classic_size(self, profile: sizing.MemoryProfile,
                      bytes_per_block: int) -> sizing.KVCacheSize:
        """This rank's classic block count; an explicit size is checked against the memory
        free now (the classic cache is allocated whole at once: above it, a CPU engine died
        with torch's "can't allocate memory" traceback, exit 1, or the host's OOM killer
        took it; the extensible path checks the same after warmup).

        Raises:
            KVCacheSizingError: see `sizing.classic_num_blocks`, or the explicit size
                does not fit the memory free now (torch's cached free blocks count).
        """
        cap = self._budget_cap()
        size = sizing.classic_num_blocks(
            profile,
            bytes_per_block,
            gpu_memory_utilization=self.plan.gpu_memory_utilization,
            explicit_bytes=self.cache.kv_cache_memory_bytes,
            free=self.memory.free_bytes() if cap is not None else 0,
            budget_cap=cap,
            budget_cap_name=self.platform.default_kv_cache_cap_name(),
        )
        explicit = self.cache.kv_cache_memory_bytes
        if explicit is not None:
            available = self.memory.free_bytes()
            if self.memory.is_cuda:  # torch's cached free blocks serve the allocation too
                available += (torch.cuda.memory_reserved(self.device)
                              - torch.cuda.memory_allocated(self.device))
            if size.num_blocks * bytes_per_block > available:
                raise sizing.KVCacheSizingError(
                    f"kv_cache_memory_bytes={explicit} exceeds the "
                    f"{available / GiB:.2f} GiB available now")
        return size

    def _budget_cap(self) -> int | None:
        """The platform's bound on a KV cache of unspecified size (CPU), if it has one."""
        if self.cache.kv_cache_memory_bytes is not None:
            return None  # an explicit size needs no default bound
        return self.platform.default_kv_cache_bytes_cap()

    def _reserve_extensible(self, specs: dict[str, KVCacheSpec]) -> KVCacheBuffers:
        driver = self.platform.get_kv_cache_vmm_driver(self.device.index or 0,
                                                       elastic=self.plan.elastic_kv_cache)
        if self._connector_reads_pages():
            # UCX's CUDA IPC exports VMM allocations as POSIX file descriptors, and a
            # NIC needs them GPUDirect-RDMA capable (both probed by the driver; the
            # host VMM has nothing to enable).
            enable = getattr(driver, "enable_transfer_flags", None)
            if enable is not None:
                enable()
        self.commits_lazily = not getattr(driver, "prefault", True)
        layout = get_kv_cache_config(specs, 1)
        explicit = self.cache.kv_cache_memory_bytes if self._packs_segments() else None
        capacity = sizing.capacity_blocks(
            self.memory.total, layout.block_stride, layout.num_segments, driver.granularity,
            max_blocks=self.max_useful_blocks, explicit_bytes=explicit,
        )
        kv_cache = ExtensibleKVCacheBuffers(get_kv_cache_config(specs, capacity), driver,
                                            self.device)
        kv_cache.allocate(sizing.WARMUP_NUM_BLOCKS)
        logger.info(
            "KV cache (extensible): reserved %.2f GiB for %d blocks, committed %.3f GiB "
            "(%d blocks) for warmup",
            kv_cache.reserved_bytes / GiB, capacity, kv_cache.committed_bytes / GiB,
            sizing.WARMUP_NUM_BLOCKS,
        )
        return kv_cache

    def _packs_segments(self) -> bool:
        """An explicit size packs the segments: the cache is then committed whole, which
        costs vLLM's block count within one granule in total. Not for the elastic cache
        (its partial prefixes would round up on both sides of a shared granule) nor with
        a KV connector (NIXL registers each segment as one allocation, which UCX cannot
        span across two; connectors register per segment)."""
        return (self.cache.kv_cache_memory_bytes is not None
                and not self.plan.elastic_kv_cache
                and (self.kv_transfer is None or not self.kv_transfer.kv_connector))

    def _connector_reads_pages(self) -> bool:
        """Whether the configured KV connector has another process read the KV pages."""
        if self.kv_transfer is None or not self.kv_transfer.kv_connector:
            return False
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        connector = KVConnectorFactory.get_connector_class(self.kv_transfer.kv_connector)
        return connector.reads_pages_from_other_processes

    def size_after_warmup(
        self, kv_cache: KVCacheBuffers, profile: sizing.MemoryProfile
    ) -> tuple[sizing.MemorySnapshot, sizing.KVCacheSize, int]:
        """This rank's measured size, and the block count agreed across ranks.

        The elastic cache's count is its limit: what it may ever hold (the
        utilization's share, the use cap), not bounded by what is free now;
        each growth checks that.
        """
        gc.collect()
        snapshot = self.memory.snapshot(kv_cache.committed_bytes, profile.activation_peak)
        layout = kv_cache.config
        size = ranks.on_every_rank(self.world_size, lambda: sizing.final_num_blocks(
            snapshot,
            activation_peak=profile.activation_peak,
            gpu_memory_utilization=self.plan.gpu_memory_utilization,
            block_stride=layout.block_stride,
            num_segments=layout.num_segments,
            granularity=kv_cache.granularity,
            capacity=kv_cache.capacity_blocks,
            explicit_bytes=self.cache.kv_cache_memory_bytes,
            budget_cap=self._budget_cap(),
            budget_cap_name=self.platform.default_kv_cache_cap_name(),
            max_blocks=self.max_useful_blocks,
            bound_by_free=not self.plan.elastic_kv_cache,
            packed_segments=self._packs_segments(),
        ))
        return snapshot, size, self.agree(size.num_blocks)

    def log_final_size(
        self, snapshot: sizing.MemorySnapshot, size: sizing.KVCacheSize, num_blocks: int,
        kv_cache: KVCacheBuffers, parts: list[tuple[str, int]],
    ) -> None:
        """One line: the budget and what limited it, what is held besides the cache, the count.

        `parts`: (name, bytes) of what the engine holds besides the KV cache
        (weights, activation peak, CUDA graph pool).
        """
        logger.info(
            "KV cache sized after warmup: budget %.2f GiB, limited by %s; free %.2f GiB, "
            "held besides KV %s, buffer %.2f GiB; "
            "KV committed %.2f GiB%s of %.2f GiB reserved: %d blocks, %d tokens of capacity",
            size.bytes.budget_bytes / GiB, size.bytes.limited_by, snapshot.free / GiB,
            sizing.describe_parts(snapshot.held_non_kv, parts), size.bytes.buffer_bytes / GiB,
            kv_cache.committed_bytes / GiB,
            " (host pages resident only once a block is written)" if self.commits_lazily else "",
            kv_cache.reserved_bytes / GiB,
            num_blocks, (num_blocks - 1) * self.cache.block_size,
        )
