"""The worker: one device's memory lifecycle around the model runner.

    init_device     platform, seed, foreign processes, free memory at start
    load_model      weights (bytes measured)
    initialize_kv_cache
        profile     one worst-case forward + the sampler over max_num_seqs
        classic     KV = utilization x total - held; allocate it all
        extensible  reserve the capacity, commit the null block + 1 warmup block
    compile_or_warm_up_model
        warmup      worst-case prefill with the KV cache, sampler, CUDA graphs
        extensible  measure free memory, size, extend under the same base
    execute_model   one scheduled step

Each stage logs one INFO line with its GiB figures.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    allocate_and_reshape_kv_cache,
    bind_kv_cache,
    get_kv_cache_config,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.memory import DeviceMemory
from vllm.v1.worker.weight_arena import WeightArena

logger = init_logger(__name__)
GiB = sizing.GiB

# Blocks committed before warmup on the extensible path: the null block and
# block 1, which every warmup batch and captured graph addresses (block
# tables of dummy requests point only at it). Warmup thus commits two blocks'
# worth of pages per segment, never memory the activation peak needs.
WARMUP_NUM_BLOCKS = 2


class Worker:
    """Runs the model on one device and owns its KV cache.

    Args:
        vllm_config: the validated engine configuration.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.config = vllm_config
        self.platform = current_platform
        self.device = self.platform.device(0)
        self.model_runner: GPUModelRunner | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.extensible: ExtensibleKVCache | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.memory: DeviceMemory | None = None
        self.profile: sizing.MemoryProfile | None = None
        self.weights_bytes = 0
        self.num_blocks = 0
        # Run once the KV cache has its final size (KV-transfer connectors
        # register committed memory only, so they must wait for the extension).
        self.post_kv_cache_hooks: list[Callable[[dict[str, torch.Tensor]], None]] = []
        self.startup_seconds: dict[str, float] = {}
        self.weight_arena: WeightArena | None = None  # with enable_sleep_mode

    # ---------------------------------------------------------------- device
    def init_device(self) -> None:
        t0 = time.perf_counter()
        self.platform.configure_torch_allocator()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.init()
        if self.config.model_config.seed is not None:
            torch.manual_seed(self.config.model_config.seed)
        self._check_foreign_processes()
        self.memory = DeviceMemory(self.platform, self.device)
        self.startup_seconds["init_device"] = time.perf_counter() - t0

    def _check_foreign_processes(self) -> None:
        """Refuse to share the device on the default utilization (DESIGN.md section 5)."""
        cache = self.config.cache_config
        others = self.platform.get_foreign_device_processes(self.device.index or 0)
        if not others:
            return
        desc = ", ".join(
            f"pid {p.pid}" + (f" ({p.used_bytes / GiB:.1f} GiB)" if p.used_bytes else "")
            for p in others
        )
        if not cache.gpu_memory_utilization_explicit:
            raise RuntimeError(
                f"another process holds memory on {self.device} ({desc}) and "
                f"--gpu-memory-utilization was left to its default "
                f"{cache.gpu_memory_utilization}: set --gpu-memory-utilization to the share "
                f"of the device this engine may use"
            )
        logger.warning(
            "Sharing %s with %s; this engine keeps to gpu_memory_utilization=%s",
            self.device,
            desc,
            cache.gpu_memory_utilization,
        )

    # ----------------------------------------------------------------- model
    def load_model(self) -> None:
        from vllm.model_executor.model_loader import get_model

        t0 = time.perf_counter()
        mc = self.config.model_config
        sc = self.config.scheduler_config
        before = self.memory.allocated()
        model = get_model(
            mc.model_path,
            mc.hf_config,
            dtype=mc.dtype,
            device=self.device,
            load_format=mc.load_format,
        )
        self.weights_bytes = max(
            self.memory.allocated() - before,
            sum(p.numel() * p.element_size() for p in model.parameters()),
        )
        comp = self.config.compilation_config
        capture_sizes = [] if comp.enforce_eager else list(comp.cudagraph_capture_sizes or [])
        self.model_runner = GPUModelRunner(
            model,
            device=self.device,
            dtype=mc.dtype,
            vocab_size=mc.get_vocab_size(),
            max_num_reqs=sc.max_num_seqs,
            max_num_tokens=sc.max_num_batched_tokens,
            max_model_len=mc.max_model_len,
            block_size=self.config.cache_config.block_size,
            cudagraph_capture_sizes=capture_sizes,
        )
        if self.config.cache_config.enable_sleep_mode:
            driver = self.platform.get_vmm_driver(self.device.index or 0)
            self.weight_arena = WeightArena(model, driver)
            gc.collect()
            self.platform.empty_cache()  # the parameters' old storage
        self.startup_seconds["load_model"] = time.perf_counter() - t0
        logger.info(
            "Model loaded: weights %.2f GiB (%s, %s) in %.1f s",
            self.weights_bytes / GiB,
            mc.dtype,
            self.device,
            self.startup_seconds["load_model"],
        )

    def _kv_cache_specs(self):
        from vllm.model_executor.models.utils import get_attention_layers

        block_size = self.config.cache_config.block_size
        dtype = self.config.model_config.dtype
        layers = get_attention_layers(self.model_runner.model)
        return layers, {
            name: layer.get_kv_cache_spec(block_size, dtype) for name, layer in layers.items()
        }

    # --------------------------------------------------------------- profile
    def _profile(self) -> sizing.MemoryProfile:
        """Step 1: one worst-case forward and the sampler; the transient peak above steady state."""
        sc = self.config.scheduler_config
        runner = self.model_runner
        num_tokens = runner.max_num_tokens
        num_reqs = min(sc.max_num_seqs, num_tokens)
        with self.memory.measure_peak() as peak:
            hidden = runner.dummy_run(num_tokens, num_reqs, with_kv=False)
            runner.dummy_sampler_run(hidden, sc.max_num_seqs)
            del hidden
        profile = sizing.MemoryProfile(
            total=self.memory.total,
            weights=self.weights_bytes,
            activation_peak=peak.torch_peak,
            non_torch=peak.non_torch_growth,
        )
        logger.info(
            "Memory profile: weights %.2f GiB, activation peak %.2f GiB, non-torch %.2f GiB "
            "(%d tokens, %d sequences)",
            profile.weights / GiB,
            profile.activation_peak / GiB,
            profile.non_torch / GiB,
            num_tokens,
            sc.max_num_seqs,
        )
        return profile

    # --------------------------------------------------------------- KV cache
    def initialize_kv_cache(self) -> int:
        """Profile, then allocate the KV cache (classic: final; extensible: warmup prefix).

        Returns:
            the number of blocks the scheduler may use now (counting the null block).
        """
        t0 = time.perf_counter()
        self.profile = self._profile()
        layers, specs = self._kv_cache_specs()
        cache = self.config.cache_config
        bytes_per_block = sum(s.page_size_bytes for s in specs.values())
        if cache.enable_extensible_kv_cache:
            num_blocks = self._reserve_extensible(specs, bytes_per_block)
        else:
            num_blocks = self._allocate_classic(specs, bytes_per_block)
        bind_kv_cache(self.kv_caches, layers)
        self.num_blocks = num_blocks
        self.startup_seconds["initialize_kv_cache"] = time.perf_counter() - t0
        return num_blocks

    def _explicit_kv_bytes(self) -> int | None:
        return self.config.cache_config.kv_cache_memory_bytes

    def _allocate_classic(self, specs, bytes_per_block: int) -> int:
        cache = self.config.cache_config
        explicit = self._explicit_kv_bytes()
        if explicit is not None:
            kv_bytes = explicit
        elif self.device.type == "cpu":
            kv_bytes = self._cpu_budget(self.memory.free())
        else:
            kv_bytes = sizing.classic_kv_cache_bytes(
                self.profile, cache.gpu_memory_utilization
            ).kv_bytes
        num_blocks = kv_bytes // bytes_per_block
        sizing.check_min_blocks(num_blocks, kv_bytes, bytes_per_block)
        self.kv_cache_config = get_kv_cache_config(specs, num_blocks)
        self.kv_caches = allocate_and_reshape_kv_cache(self.kv_cache_config, self.device)
        logger.info(
            "KV cache (classic): %.2f GiB, %d blocks, %d tokens of capacity",
            self.kv_cache_config.size_bytes / GiB,
            num_blocks,
            (num_blocks - 1) * cache.block_size,
        )
        return num_blocks

    def _cpu_budget(self, available: int) -> int:
        """Host memory is shared with everything else: a bounded default."""
        cap = self.platform.default_kv_cache_bytes_cap()
        return min(cap, available) if cap is not None else available

    def _reserve_extensible(self, specs, bytes_per_block: int) -> int:
        driver = self.platform.get_vmm_driver(self.device.index or 0)
        probe = driver.probe()
        if probe is not None:  # config resolution already checked; the device may differ
            raise RuntimeError(f"extensible KV cache unavailable on {self.device}: {probe}")
        # Capacity: the most blocks that could ever fit the device. Reserving
        # address space costs nothing physical. Rounded so every segment's
        # capacity ends on a granule (no granule shared between segments).
        probe_config = get_kv_cache_config(specs, 1)
        stride = probe_config.block_stride
        granularity = driver.granularity
        align = granularity // math.gcd(granularity, stride)
        capacity = max(self.memory.total // bytes_per_block, WARMUP_NUM_BLOCKS)
        capacity = -(-capacity // align) * align
        self.kv_cache_config = get_kv_cache_config(specs, capacity)
        self.extensible = ExtensibleKVCache(self.kv_cache_config, driver, self.device)
        self.kv_caches = self.extensible.allocate(WARMUP_NUM_BLOCKS)
        logger.info(
            "KV cache (extensible): reserved %.2f GiB for %d blocks, committed %.3f GiB "
            "(%d blocks) for warmup",
            self.extensible.reserved_bytes / GiB,
            capacity,
            self.extensible.physical_bytes / GiB,
            WARMUP_NUM_BLOCKS,
        )
        return WARMUP_NUM_BLOCKS

    # ----------------------------------------------------------------- warmup
    def compile_or_warm_up_model(self) -> int:
        """Warm up (worst-case prefill with KV, sampler) and capture CUDA graphs.

        On the extensible path, then measure and extend the cache.

        Returns:
            the final number of KV blocks (counting the null block).
        """
        t0 = time.perf_counter()
        runner = self.model_runner
        sc = self.config.scheduler_config
        num_tokens = runner.max_num_tokens
        num_reqs = min(sc.max_num_seqs, num_tokens)
        hidden = runner.dummy_run(num_tokens, num_reqs, with_kv=True)
        runner.dummy_sampler_run(hidden, sc.max_num_seqs)
        del hidden
        if runner.use_cuda_graph:
            runner.capture_model()
            # torch.cuda.graph empties torch's cache when capture begins, so the
            # activation pool is gone; run the worst case once more so the pool
            # holds it again, in runtime's allocation pattern, before measuring.
            hidden = runner.dummy_run(num_tokens, num_reqs, with_kv=True)
            runner.dummy_sampler_run(hidden, sc.max_num_seqs)
            del hidden
        self.memory.synchronize()
        self.startup_seconds["warmup"] = time.perf_counter() - t0
        if self.extensible is not None:
            self.num_blocks = self._extend_after_warmup()
        return self.num_blocks

    def _extend_after_warmup(self) -> int:
        t0 = time.perf_counter()
        cache = self.config.cache_config
        ext = self.extensible
        gc.collect()
        free = self.memory.free()
        committed = ext.physical_bytes
        # Activation memory the runtime will take back from the device (it is
        # free now if graph capture emptied torch's cache): count it as held.
        shortfall = self.memory.torch_shortfall(self.profile.activation_peak)
        held_non_kv = max(self.memory.used_since_start(free) - committed, 0) + shortfall
        free -= shortfall
        explicit = self._explicit_kv_bytes()
        if explicit is not None:
            result = sizing.SizingResult(explicit, explicit, 0)
            if explicit > free + committed:
                raise sizing.KVCacheSizingError(
                    f"kv_cache_memory_bytes={explicit} exceeds the "
                    f"{(free + committed) / GiB:.2f} GiB available after warmup"
                )
        else:
            cap = self._cpu_budget(free + committed) if self.device.type == "cpu" else None
            result = sizing.extensible_kv_cache_bytes(
                total=self.memory.total,
                free=free,
                kv_committed=committed,
                held_non_kv=held_non_kv,
                activation_peak=self.profile.activation_peak,
                gpu_memory_utilization=cache.gpu_memory_utilization,
                budget_cap=cap,
            )
        bytes_per_block = ext.block_stride * ext.num_segments
        if explicit is not None:
            # An explicit size is a number of KV bytes the user wants: that many
            # blocks; the commit rounds each segment up to the granularity.
            num_blocks = explicit // bytes_per_block
        else:
            # A measured budget is a hard limit: round down to whole granules.
            num_blocks = sizing.num_blocks_for_bytes(
                result.kv_bytes, ext.block_stride, ext.num_segments, ext.driver.granularity
            )
        num_blocks = min(num_blocks, ext.capacity_blocks)
        sizing.check_min_blocks(num_blocks, result.kv_bytes, bytes_per_block)
        self.extend_kv_cache(num_blocks)
        self.startup_seconds["extend"] = time.perf_counter() - t0
        graphs = self.model_runner.cuda_graphs
        # The graph pool exists only where graphs were captured (not on CPU, not eager).
        pool = f", CUDA graph pool {graphs.pool_bytes / GiB:.2f}" if graphs.captured else ""
        logger.info(
            "KV cache sized after warmup: free %.2f GiB, held besides KV %.2f GiB "
            "(weights %.2f, activation peak %.2f%s), buffer %.2f GiB; "
            "KV committed %.2f GiB of %.2f GiB reserved: %d blocks, %d tokens of capacity",
            (free + shortfall) / GiB,
            held_non_kv / GiB,
            self.weights_bytes / GiB,
            self.profile.activation_peak / GiB,
            pool,
            result.buffer_bytes / GiB,
            ext.physical_bytes / GiB,
            ext.reserved_bytes / GiB,
            num_blocks,
            (num_blocks - 1) * cache.block_size,
        )
        return num_blocks

    def extend_kv_cache(self, num_blocks: int) -> None:
        """Commit the cache to `num_blocks` blocks under the same base and rebind the views.

        Grows in place; if warmup committed more than `num_blocks`, remaps smaller
        (warmup's contents are garbage).
        """
        ext = self.extensible
        if num_blocks >= ext.num_blocks:
            views = ext.commit(num_blocks)
        else:
            views = ext.remap(num_blocks)
        self.kv_caches.update(views)
        layers, _ = self._kv_cache_specs()
        bind_kv_cache(self.kv_caches, layers)
        self.num_blocks = num_blocks

    def run_post_kv_cache_hooks(self) -> None:
        for hook in self.post_kv_cache_hooks:
            hook(self.kv_caches)

    # ----------------------------------------------------------------- sleep
    def sleep(self, level: int) -> None:
        """Release weights' and KV cache's pages, keeping every address.

        Level 1 keeps a host copy of the weights; level 2 keeps nothing (reload
        with `reload_weights` after waking). KV contents are discarded at both.
        torch's cached (unused) memory is returned too.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.weight_arena is None or self.extensible is None:
            raise RuntimeError("sleep needs enable_sleep_mode=True and the extensible KV cache")
        self.memory.synchronize()
        self.weight_arena.sleep(keep_on_host=level == 1)
        self.extensible.release()
        gc.collect()
        self.platform.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Map fresh pages for "weights" and/or "kv_cache" (both when tags is None).

        Returns:
            False if weights were woken after a level-2 sleep and must be reloaded.

        Raises:
            ValueError: an unknown tag.
            VmmError: not enough device memory; what could not be mapped stays
                asleep (a later call can retry).
        """
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights', 'kv_cache'")
        restored = True
        if "weights" in tags:
            restored = self.weight_arena.wake_up()
        if "kv_cache" in tags and self.extensible.tensor.is_released:
            self.extensible.recommit()
        return restored

    def sleeping_tags(self) -> list[str]:
        """Which of "weights" / "kv_cache" are asleep now."""
        tags = []
        if self.weight_arena is not None and self.weight_arena.is_sleeping:
            tags.append("weights")
        if self.extensible is not None and self.extensible.tensor.is_released:
            tags.append("kv_cache")
        return tags

    def reload_weights(self) -> None:
        """Load the checkpoint again into the (awake) parameters, in place."""
        from vllm.model_executor.model_loader import get_model_loader

        mc = self.config.model_config
        loader = get_model_loader(mc.load_format, mc.model_path)
        with torch.inference_mode(False), torch.no_grad():
            loader.load_weights(self.model_runner.model, mc.model_path)

    # ------------------------------------------------------------------ step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def kv_cache_memory(self) -> dict[str, int]:
        """Bytes committed and reserved, and blocks, for metrics."""
        if self.extensible is not None:
            return {
                "committed_bytes": self.extensible.physical_bytes,
                "reserved_bytes": self.extensible.reserved_bytes,
                "num_blocks": self.num_blocks,
            }
        size = self.kv_cache_config.size_bytes if self.kv_cache_config else 0
        return {"committed_bytes": size, "reserved_bytes": size, "num_blocks": self.num_blocks}

    def shutdown(self) -> None:
        self.kv_caches.clear()
        if self.model_runner is not None:
            layers, _ = self._kv_cache_specs()
            for layer in layers.values():
                layer.kv_cache = None
        if self.extensible is not None:
            self.extensible.free()
        self.model_runner = None
        if self.weight_arena is not None:
            self.weight_arena.free()
            self.weight_arena = None
        gc.collect()
        self.platform.empty_cache()
