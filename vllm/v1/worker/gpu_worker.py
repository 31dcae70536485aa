"""The worker: one device's memory lifecycle around the model runner.

    init_device     platform, seed, foreign processes, free memory at start
    load_model      weights (bytes measured)
    initialize_kv_cache
        profile     one worst-case forward + the sampler over max_num_seqs (+ the
                    worst-case spec-decode verify batch, as vLLM's profile run)
        KV cache    the one place that picks the KV cache object:
                      classic     final size from the profile; allocate it all
                      extensible  reserve the capacity, commit the warmup blocks
    compile_or_warm_up_model
        warmup      worst-case prefill with the KV cache (on CUDA also as a few
                    long prompts: the fresh-prefill kernel's buffers), sampler,
                    verify batch, CUDA graphs (decode and verify batches)
        size        what is free now -> final block count (kv_cache_sizing.py),
                    agreed across ranks; a fully committed cache keeps its size
        extend      extend_kv_cache(final) under the same base, rebind the views
    run_post_kv_cache_hooks   (KV connectors: they see the final, committed cache)
    execute_model   one scheduled step

Each stage logs one INFO line with its GiB figures. The worker holds one
`KVCacheBuffers` (kv_cache.py) and never asks which kind it is after creating it.
Three concerns live in mixins of their own: sleep / wake (sleep_mode.py), the
speculative-decoding set-up (spec_decode_worker.py), the elastic cache's calls
(elastic_kv_cache.py).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheSpec, get_kv_cache_config
from vllm.v1.outputs import AsyncModelRunnerOutput, KVCacheMemory, ModelRunnerOutput
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker import ranks, sharing
from vllm.v1.worker.elastic_kv_cache import ElasticKVCache, ElasticWorkerMixin
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.kv_cache import (
    ClassicKVCacheBuffers,
    ExtensibleKVCacheBuffers,
    KVCacheBuffers,
)
from vllm.v1.worker.memory import DeviceMemory
from vllm.v1.worker.sleep_mode import SleepModeWorkerMixin
from vllm.v1.worker.spec_decode_worker import SpecDecodeWorkerMixin
from vllm.v1.worker.weight_arena import WeightArena

if TYPE_CHECKING:
    from vllm.v1.worker.kv_connector import WorkerKVConnector

logger = init_logger(__name__)
GiB = sizing.GiB


class Worker(SleepModeWorkerMixin, SpecDecodeWorkerMixin, ElasticWorkerMixin):
    """Runs the model on one device (one rank) and owns its KV cache.

    Args:
        vllm_config: the validated engine configuration.
        local_rank: the device index on this node.
        rank: the global rank (its shard of the model: tensor-parallel rank).
        distributed_init_method: the ranks' rendezvous ("tcp://host:port");
            None for a single-rank engine, which creates no process group.
        is_driver_worker: rank 0 (whose outputs the engine reads).
        agree_num_blocks: the seam where ranks agree on a block count: takes
            this rank's count, returns the one every rank uses. Default: the
            minimum over every rank's count (`ranks.agree_on_num_blocks`, an
            all-gather over the world group; this rank's own with one rank).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int = 0,
        rank: int = 0,
        distributed_init_method: str | None = None,
        is_driver_worker: bool = True,
        agree_num_blocks: Callable[[int], int] | None = None,
    ) -> None:
        self.config = vllm_config
        self.platform = current_platform
        self.local_rank = local_rank
        self.rank = rank
        self.world_size = vllm_config.parallel_config.world_size
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device = self.platform.device(local_rank)
        self.agree_num_blocks = agree_num_blocks or self._agree_across_ranks
        # Every rank's proposed block count at the last agreement (rank order).
        self.kv_cache_proposals: list[int] = []
        self.model_runner: GPUModelRunner | None = None
        self.kv_cache: KVCacheBuffers | None = None
        self.memory: DeviceMemory | None = None
        self.profile: sizing.MemoryProfile | None = None
        self.weights_bytes = 0
        # Run once the KV cache has its final size (KV-transfer connectors
        # register committed memory only, `KVCacheBuffers.committed_spans()`,
        # so they must wait for the extension).
        self.post_kv_cache_hooks: list[Callable[[KVCacheBuffers], None]] = []
        self.startup_seconds: dict[str, float] = {}
        self.weight_arena: WeightArena | None = None  # with enable_sleep_mode
        self.kv_connector: WorkerKVConnector | None = None  # with kv_transfer_config
        if vllm_config.kv_transfer_config is not None:
            self.post_kv_cache_hooks.append(self._create_kv_connector)
        self.spec_decode_peak = 0  # bytes: the profiled verify batch's peak (spec decode)

        self.elastic: ElasticKVCache | None = None  # with enable_elastic_kv_cache

    # ---------------------------------------------------------------- device
    def init_device(self) -> None:
        t0 = time.perf_counter()
        self.platform.configure_torch_allocator()
        self.platform.configure_threads()
        # Before a context exists (on a device others filled, it would not fit).
        sharing.check_device_fits(self.platform, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.init()
        if self.distributed_init_method is not None:  # started by an mp / ray executor
            ranks.register_engine_process(self.platform)
        if self.world_size > 1:
            ranks.join_process_group(
                self.world_size,
                self.rank,
                self.distributed_init_method,
                self.local_rank,
                self.config.parallel_config.tensor_parallel_size,
                self.platform,
            )
        if self.config.model_config.seed is not None:
            torch.manual_seed(self.config.model_config.seed)
        sharing.check_sharing(self.platform, self.device, self.config.cache_config)
        self.memory = DeviceMemory(self.platform, self.device)
        self.startup_seconds["init_device"] = time.perf_counter() - t0

    # ----------------------------------------------------------------- model
    def load_model(self) -> None:
        from vllm.model_executor.model_loader import get_model

        t0 = time.perf_counter()
        mc = self.config.model_config
        sc = self.config.scheduler_config
        before = self.memory.allocated()
        tp_rank, tp_size = ranks.tensor_parallel_rank(self.world_size)
        logger.info("Loading the model from %s (%s, %s) ...", mc.model_path, mc.load_format,
                    self.device)
        model = get_model(
            mc.model_path,
            mc.hf_config,
            dtype=mc.dtype,
            device=self.device,
            load_format=mc.load_format,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        draft_model = self._load_draft_model()
        params = [*model.parameters(), *(draft_model.parameters() if draft_model else [])]
        self.weights_bytes = max(
            self.memory.allocated() - before,
            sum(p.numel() * p.element_size() for p in params),
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
            spec_decoder=self._spec_decoder(mc.get_vocab_size(), draft_model),
            async_scheduling=bool(sc.async_scheduling),
        )
        if self.config.cache_config.enable_sleep_mode:
            self._create_weight_arena(model)
        self.startup_seconds["load_model"] = time.perf_counter() - t0
        logger.info(
            "Model loaded: weights %.2f GiB (%s, %s) in %.1f s",
            self.weights_bytes / GiB,
            mc.dtype,
            self.device,
            self.startup_seconds["load_model"],
        )

    def _kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_specs(self.config.model_config.dtype)

    # --------------------------------------------------------------- profile
    def _worst_case_batch(self) -> tuple[int, int]:
        """(tokens, requests) of the largest step the scheduler can make.

        At most `max_num_batched_tokens` tokens, and at most `max_model_len`
        per request over `max_num_seqs` requests: a dummy request longer than
        `max_model_len` would read past its block-table row (on CUDA, an
        illegal address when `max_num_seqs x max_model_len` is below
        `max_num_batched_tokens`).
        """
        sc = self.config.scheduler_config
        num_tokens = min(self.model_runner.max_num_tokens,
                         sc.max_num_seqs * self.config.model_config.max_model_len)
        return num_tokens, min(sc.max_num_seqs, num_tokens)

    def _profile(self) -> sizing.MemoryProfile:
        """Step 1: one worst-case forward and the sampler; the transient peak above steady state."""
        sc = self.config.scheduler_config
        runner = self.model_runner
        num_tokens, num_reqs = self._worst_case_batch()
        logger.info("Profiling memory: a worst-case forward of %d tokens and the sampler over "
                    "%d sequences ...", num_tokens, sc.max_num_seqs)
        with self.memory.measure_peak() as peak:
            hidden = runner.dummy_run(num_tokens, num_reqs, with_kv=False)
            runner.dummy_sampler_run(hidden, sc.max_num_seqs)
        spec_peak = self._profile_verify(hidden)
        activation_peak = max(peak.torch_peak, spec_peak.torch_peak)
        del hidden
        profile = sizing.MemoryProfile(
            total=self.memory.total,
            weights=self.weights_bytes,
            activation_peak=activation_peak,
            non_torch=max(peak.non_torch_growth, spec_peak.non_torch_growth),
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
        """Profile, then create and allocate the KV cache (classic: final; extensible: warmup).

        Returns:
            the number of blocks committed now (counting the null block).
        """
        t0 = time.perf_counter()
        self.profile = self._profile()
        self.kv_cache = self._new_kv_cache(self._kv_cache_specs())
        self.model_runner.bind_kv_cache(self.kv_cache.views)
        self.startup_seconds["initialize_kv_cache"] = time.perf_counter() - t0
        return self.kv_cache.committed_blocks

    def _new_kv_cache(self, specs: dict[str, KVCacheSpec]) -> KVCacheBuffers:
        """The one place that picks the KV cache object; everything else asks it."""
        if self.config.cache_config.enable_extensible_kv_cache:
            return self._reserve_extensible(specs)
        return self._allocate_classic(specs)

    def _allocate_classic(self, specs: dict[str, KVCacheSpec]) -> KVCacheBuffers:
        cache = self.config.cache_config
        bytes_per_block = sum(s.page_size_bytes for s in specs.values())
        cap = self._budget_cap()
        size = ranks.on_every_rank(self.world_size, lambda: sizing.classic_num_blocks(
            self.profile,
            bytes_per_block,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            explicit_bytes=cache.kv_cache_memory_bytes,
            free=self.memory.free_bytes() if cap is not None else 0,
            budget_cap=cap,
            budget_cap_name=self.platform.default_kv_cache_cap_name(),
        ))
        num_blocks = self.agree_num_blocks(size.num_blocks)
        kv_cache = ClassicKVCacheBuffers(get_kv_cache_config(specs, num_blocks), self.device)
        kv_cache.allocate(num_blocks)
        logger.info(
            "KV cache (classic): %.2f GiB (budget %.2f GiB, limited by %s), %d blocks, "
            "%d tokens of capacity",
            kv_cache.config.size_bytes / GiB,
            size.bytes.budget_bytes / GiB,
            size.bytes.limited_by,
            num_blocks,
            (num_blocks - 1) * cache.block_size,
        )
        return kv_cache

    def _agree_across_ranks(self, num_blocks: int) -> int:
        agreed, self.kv_cache_proposals = ranks.agree_on_num_blocks(
            self.world_size, self.rank, num_blocks
        )
        return agreed

    def kv_cache_agreement(self) -> list[int]:
        """Every rank's proposed block count at the last agreement, in rank order."""
        return list(self.kv_cache_proposals)

    def probe_kv_cache_path(self) -> str | None:
        """Why this rank's device cannot hold the extensible cache, or None if it can."""
        return self.platform.get_vmm_driver(self.device.index or 0).probe()

    def use_classic_kv_cache(self, reason: str) -> None:
        """Another rank cannot hold the extensible cache: this one takes the classic path too."""
        self.config.cache_config.fall_back_to_classic(reason)

    def _budget_cap(self) -> int | None:
        """The platform's bound on a KV cache of unspecified size (CPU), if it has one."""
        if self.config.cache_config.kv_cache_memory_bytes is not None:
            return None  # an explicit size needs no default bound
        return self.platform.default_kv_cache_bytes_cap()

    def _reserve_extensible(self, specs: dict[str, KVCacheSpec]) -> KVCacheBuffers:
        driver = self.platform.get_vmm_driver(self.device.index or 0)
        probe = driver.probe()
        if probe is not None:  # config resolution already checked; the device may differ
            raise RuntimeError(f"extensible KV cache unavailable on {self.device}: {probe}")
        kv_transfer = self.config.kv_transfer_config
        if kv_transfer is not None and kv_transfer.kv_connector == "NixlConnector":
            # NIXL reads these pages from another process: UCX's CUDA IPC exports
            # VMM allocations as POSIX file descriptors, and a NIC needs them
            # GPUDirect-RDMA capable (both probed by the driver; host VMM: no-op).
            enable = getattr(driver, "enable_transfer_flags", None)
            if enable is not None:
                enable()
        layout = get_kv_cache_config(specs, 1)
        capacity = sizing.capacity_blocks(
            self.memory.total, layout.block_stride, layout.num_segments, driver.granularity,
            max_blocks=self._max_useful_blocks(),
        )
        kv_cache = ExtensibleKVCacheBuffers(
            get_kv_cache_config(specs, capacity), driver, self.device
        )
        kv_cache.allocate(sizing.WARMUP_NUM_BLOCKS)
        logger.info(
            "KV cache (extensible): reserved %.2f GiB for %d blocks, committed %.3f GiB "
            "(%d blocks) for warmup",
            kv_cache.reserved_bytes / GiB,
            capacity,
            kv_cache.committed_bytes / GiB,
            sizing.WARMUP_NUM_BLOCKS,
        )
        return kv_cache

    # ----------------------------------------------------------------- warmup
    def compile_or_warm_up_model(self) -> int:
        """Warm up (worst-case prefill with KV, sampler), capture CUDA graphs, size, extend.

        Returns:
            the final number of KV blocks (counting the null block), the same on
            every rank.
        """
        t0 = time.perf_counter()
        runner = self.model_runner
        num_tokens, num_reqs = self._worst_case_batch()
        logger.info("Warming up: a worst-case prefill of %d tokens with the KV cache, the "
                    "sampler%s ...", num_tokens,
                    f", then CUDA graph capture of {len(runner.cuda_graphs.capture_sizes)} decode "
                    "sizes" if runner.use_cuda_graph else "")
        self._warmup_batch(num_tokens, num_reqs)
        # Every attention variant a request can select, compiled now rather
        # than while a user waits (issue 10).
        launches = runner.warm_up_kernels()
        # A one-token step: the small-batch kernels (norm / SiLU fused into the
        # projections, layers/fused_linear.py) that the worst case above does
        # not reach; CUDA-graph capture would compile them too, eager mode not.
        hidden = runner.dummy_run(1, 1, with_kv=True)
        runner.warm_up_logits(hidden, self.config.scheduler_config.max_num_seqs)
        del hidden
        if launches:
            logger.info("Attention kernels warmed up: %d variants", launches)
        if runner.use_cuda_graph:
            runner.capture_model()
            # torch.cuda.graph empties torch's cache when capture begins, so the
            # activation pool is gone; run the worst case once more so the pool
            # holds it again, in runtime's allocation pattern, before measuring.
            self._warmup_batch(num_tokens, num_reqs)
        self.memory.synchronize()
        self.startup_seconds["warmup"] = time.perf_counter() - t0
        ranks.resync_random_state(self.world_size, self.config.model_config.seed)
        kv_cache = self.kv_cache
        if kv_cache.committed_blocks == kv_cache.capacity_blocks:
            # Fully committed (the classic cache, sized before warmup): nothing
            # to grow into, so nothing to measure.
            self._warm_up_last_step()
            return kv_cache.committed_blocks
        t0 = time.perf_counter()
        snapshot, size, num_blocks = self._size_after_warmup()
        if self.config.cache_config.enable_elastic_kv_cache:
            num_blocks = self._start_elastic(num_blocks)
        else:
            self.extend_kv_cache(num_blocks)
        self._warm_up_last_step()
        self.startup_seconds["extend"] = time.perf_counter() - t0
        self._log_final_size(snapshot, size, num_blocks)
        return num_blocks

    def _warm_up_last_step(self) -> None:
        """One small step, the last thing before serving (CUDA only).

        On the H200 the first gather after start-up took 13.8 ms (the next
        0.16 ms) although warmup had run the same gather before the cache grew;
        the engine's first request paid it (SmolLM2 shape, issue 10). The cause
        inside CUDA is not known; a step here, on the final cache, removes it.
        """
        if self.device.type == "cuda":
            runner = self.model_runner
            runner.warm_up_logits(runner.dummy_run(1, 1, with_kv=True), 1)

    def _warmup_batch(self, num_tokens: int, num_reqs: int) -> None:
        """Worst-case prefill with the KV cache, the sampler, the worst-case verify batch."""
        runner = self.model_runner
        hidden = runner.dummy_run(num_tokens, num_reqs, with_kv=True)
        runner.dummy_sampler_run(hidden, self.config.scheduler_config.max_num_seqs)
        if self.device.type == "cuda":
            self._warm_up_long_prompts(num_tokens, num_reqs)
        positions = self._verify_positions()
        if positions:
            runner.spec_decoder.dummy_verify_run(runner.model, hidden, positions)
        del hidden

    def _warm_up_long_prompts(self, num_tokens: int, num_reqs: int) -> None:
        """The same tokens as a few prompts of up to max_model_len (CUDA only).

        A step of long fresh prompts takes `prefill_attention`, whose rotated-key
        rows ([num_tokens, num_kv_heads x head_size]) the worst case of many short
        prompts does not allocate; running it here puts them in torch's pool
        before the free memory is measured (and compiles what it launches).
        """
        from vllm.v1.attention.ops.attention_config import FRESH_PREFILL_MIN_QUERY_LEN

        runner = self.model_runner
        long_reqs = -(-num_tokens // runner.max_model_len)
        if num_tokens // num_reqs < FRESH_PREFILL_MIN_QUERY_LEN <= num_tokens // long_reqs:
            runner.dummy_run(num_tokens, long_reqs, with_kv=True)

    def _size_after_warmup(self) -> tuple[sizing.MemorySnapshot, sizing.KVCacheSize, int]:
        """This rank's measured size, and the block count agreed across ranks."""
        cache = self.config.cache_config
        kv_cache = self.kv_cache
        gc.collect()
        snapshot = self.memory.snapshot(kv_cache.committed_bytes, self.profile.activation_peak)
        sized = snapshot
        if cache.enable_elastic_kv_cache:
            # The limit is what the engine may ever hold (gpu_memory_utilization
            # x total, the use cap); what is free is checked at every growth.
            sized = dataclasses.replace(snapshot, free=snapshot.total)
        size = ranks.on_every_rank(self.world_size, lambda: sizing.final_num_blocks(
            sized,
            activation_peak=self.profile.activation_peak,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            block_stride=kv_cache.config.block_stride,
            num_segments=kv_cache.config.num_segments,
            granularity=kv_cache.granularity,
            capacity=kv_cache.capacity_blocks,
            explicit_bytes=cache.kv_cache_memory_bytes,
            budget_cap=self._budget_cap(),
            budget_cap_name=self.platform.default_kv_cache_cap_name(),
            max_blocks=self._max_useful_blocks(),
        ))
        return snapshot, size, self.agree_num_blocks(size.num_blocks)

    def _max_useful_blocks(self) -> int:
        """Blocks `max_num_seqs x max_model_len` can address (the extensible cache's cap)."""
        return sizing.max_useful_blocks(
            self.config.scheduler_config.max_num_seqs,
            self.config.model_config.max_model_len,
            self.config.cache_config.block_size,
        )

    def _log_final_size(
        self, snapshot: sizing.MemorySnapshot, size: sizing.KVCacheSize, num_blocks: int
    ) -> None:
        graphs = self.model_runner.cuda_graphs
        parts = [("weights", self.weights_bytes), ("activation peak", self.profile.activation_peak)]
        # The graph pool exists only where graphs were captured (not on CPU, not eager).
        if graphs.captured:
            parts.append(("CUDA graph pool", graphs.pool_bytes))
        logger.info(
            "KV cache sized after warmup: budget %.2f GiB, limited by %s; free %.2f GiB, "
            "held besides KV %s, buffer %.2f GiB; "
            "KV committed %.2f GiB of %.2f GiB reserved: %d blocks, %d tokens of capacity",
            size.bytes.budget_bytes / GiB,
            size.bytes.limited_by,
            snapshot.free / GiB,
            sizing.describe_parts(snapshot.held_non_kv, parts),
            size.bytes.buffer_bytes / GiB,
            self.kv_cache.committed_bytes / GiB,
            self.kv_cache.reserved_bytes / GiB,
            num_blocks,
            (num_blocks - 1) * self.config.cache_config.block_size,
        )

    def extend_kv_cache(self, num_blocks: int) -> None:
        """Commit the cache to `num_blocks` blocks under the same base and rebind the views.

        Grow-only; equal counts are a no-op. CUDA graphs captured before stay
        valid (same addresses). The elastic cache will call this while serving.

        Raises:
            ValueError: past the capacity, below what is committed, or any
                change of a classic cache.
        """
        self.model_runner.bind_kv_cache(self.kv_cache.extend_kv_cache(num_blocks))

    def run_post_kv_cache_hooks(self) -> None:
        """Call each hook with the KV cache at its final size (connectors register here)."""
        for hook in self.post_kv_cache_hooks:
            hook(self.kv_cache)

    def kv_connector_handshake(self) -> dict | None:
        """The worker-side connector's handshake metadata for its scheduler side."""
        return None if self.kv_connector is None else self.kv_connector.handshake()

    def _create_kv_connector(self, kv_cache: KVCacheBuffers) -> None:
        from vllm.v1.worker.kv_connector import WorkerKVConnector

        self.kv_connector = WorkerKVConnector.create(self.config, kv_cache)

    # ------------------------------------------------------------------ step
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        if self.kv_connector is not None:
            return self.kv_connector.execute(scheduler_output, self.model_runner.execute_model)
        return self.model_runner.execute_model(scheduler_output)

    def kv_cache_memory(self) -> KVCacheMemory:
        """Bytes committed and reserved, and committed blocks, for metrics."""
        if self.kv_cache is None:
            return KVCacheMemory(0, 0, 0)
        return self.kv_cache.memory()

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()  # deregister before the memory goes
            self.kv_connector = None
        if self.model_runner is not None:
            self.model_runner.bind_kv_cache({})
        if self.kv_cache is not None:
            self.kv_cache.free()
        self.model_runner = None
        if self.weight_arena is not None:
            self.weight_arena.free()
            self.weight_arena = None
        gc.collect()
        self.platform.empty_cache()
        ranks.leave_process_group(self.world_size)
