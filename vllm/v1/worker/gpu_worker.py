"""The worker: one device's memory lifecycle around the model runner.

    init_device          platform, process groups, seed, device fits and sharing
    probe_kv_cache_path  this device's VMM probe (the engine decides the plan)
    load_model(plan)     weights (bytes measured), draft model, the runner
    initialize_kv_cache
        profile     one worst-case forward + the sampler over max_num_seqs (+ the
                    worst-case spec-decode verify batch, as vLLM's profile run)
        KV cache    `KVCacheSetup.allocate`: classic: final size from the profile;
                    extensible: reserve the capacity, commit the warmup blocks
    compile_or_warm_up_model
        warmup      worst-case prefill with the KV cache (on CUDA also as a few
                    long prompts: the fresh-prefill kernel's buffers), sampler,
                    verify batch, CUDA graphs (decode and verify batches)
        size        what is free now -> final block count (kv_cache_sizing.py),
                    agreed across ranks; a fully committed cache keeps its size
        extend      extend_kv_cache(final) under the same base, rebind the views
                    (elastic: commit the floor; the rest comes while serving)
    run_post_kv_cache_hooks   (KV connectors: they see the final, committed cache)
    execute_model   one scheduled step

Each stage logs one INFO line with its GiB figures. What the engine may call
is exactly the `@rpc` methods (worker_base.py). The worker owns its parts as
fields and never asks which kind its KV cache is after creating it:
`kv_cache` (kv_cache.py), `kv_setup` (kv_cache_setup.py, start-up sizing),
`sleep_state` (sleep_mode.py, with sleep mode), `elastic` (elastic_kv_cache.py,
with the elastic cache), `kv_connector` (kv_connector.py, with a KV connector).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from vllm.config import VllmConfig
from vllm.config.startup import StartupPlan
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, KVCacheMemory, ModelRunnerOutput
from vllm.v1.structured_output import backend_tokenizers
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker import ranks, sharing
from vllm.v1.worker import spec_decode_worker as spec_decode
from vllm.v1.worker.elastic_kv_cache import ElasticBounds, ElasticKVCache
from vllm.v1.worker.encoder_sizing import EncoderBudget, EncoderSizing, encoder_sizing
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.kv_cache import KVCacheBuffers
from vllm.v1.worker.kv_cache_setup import KVCacheSetup
from vllm.v1.worker.kv_connector import WorkerKVConnector
from vllm.v1.worker.memory import DeviceMemory
from vllm.v1.worker.sleep_mode import SleepState
from vllm.v1.worker.weight_arena import WeightArena
from vllm.v1.worker.worker_base import rpc

logger = init_logger(__name__)
GiB = sizing.GiB


class Worker:
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
        self.plan: StartupPlan | None = None  # the engine's, from load_model
        self.memory: DeviceMemory | None = None
        self.model_runner: GPUModelRunner | None = None
        self.weights_bytes = 0
        self.profile: sizing.MemoryProfile | None = None
        self.spec_decode_peak = 0  # bytes: the profiled verify batch's peak (spec decode)
        self.startup_seconds: dict[str, float] = {}
        # The parts, as they come to exist:
        self.kv_setup: KVCacheSetup | None = None
        self.kv_cache: KVCacheBuffers | None = None
        self.weight_arena: WeightArena | None = None  # with enable_sleep_mode
        self.sleep_state: SleepState | None = None  # with enable_sleep_mode
        self.elastic: ElasticKVCache | None = None  # with enable_elastic_kv_cache
        self.kv_connector: WorkerKVConnector | None = None  # with kv_transfer_config
        self.encoder: EncoderSizing | None = None  # a multimodal model's vision encoder
        self.encoder_budget: EncoderBudget | None = None  # what _profile reserved for it

    # ---------------------------------------------------------------- device
    @rpc
    def init_device(self) -> None:
        t0 = time.perf_counter()
        self.platform.configure_torch_allocator()
        self.platform.configure_threads()
        # Before a context exists (on a device others filled, it would not fit).
        sharing.check_device_fits(self.platform, self.device)
        self.platform.init_device(self.device)
        if self.distributed_init_method is not None:  # started by an mp / ray executor
            ranks.register_engine_process(self.platform)
        if self.world_size > 1:
            ranks.join_process_group(
                self.world_size, self.rank, self.distributed_init_method, self.local_rank,
                self.config.parallel_config.tensor_parallel_size, self.platform,
            )
        if self.config.model_config.seed is not None:
            torch.manual_seed(self.config.model_config.seed)
        sharing.check_sharing(self.platform, self.device, self.config.cache_config)
        self.memory = DeviceMemory(self.platform, self.device)
        self.startup_seconds["init_device"] = time.perf_counter() - t0

    @rpc
    def get_encoder_budget(self) -> EncoderBudget | None:
        """What the profile reserved for the vision encoder (None: a text-only model)."""
        return self.encoder_budget

    @rpc
    def probe_kv_cache_path(self) -> str | None:
        """Why this rank's device cannot hold the extensible cache, or None if it can."""
        return self.platform.get_vmm_driver(self.device.index or 0).probe()

    # ----------------------------------------------------------------- model
    @rpc
    def load_model(self, plan: StartupPlan) -> None:
        """Load the weights (and a draft model) and build the runner, under `plan`."""
        from vllm.model_executor.model_loader import get_model

        t0 = time.perf_counter()
        self.plan = plan
        # Structured outputs: this process's grammar tokenizer builds in the background
        # (a pickled grammar from the engine core finds it by its key; one build per process).
        backend_tokenizers.prepare_for(self.config)
        mc, sc = self.config.model_config, self.config.scheduler_config
        before = self.memory.allocated()
        tp_rank, tp_size = ranks.tensor_parallel_rank(self.world_size)
        logger.info("Loading the model from %s (%s, %s) ...", mc.model_path, mc.load_format,
                    self.device)
        model = get_model(mc.model_path, mc.hf_config, dtype=mc.dtype, device=self.device,
                          load_format=mc.load_format, tp_rank=tp_rank, tp_size=tp_size)
        spec = self.config.speculative_config
        draft_model = spec_decode.load_draft_model(spec, mc, self.device)
        params = [*model.parameters(), *(draft_model.parameters() if draft_model else [])]
        self.weights_bytes = max(self.memory.allocated() - before,
                                 sum(p.numel() * p.element_size() for p in params))
        comp = self.config.compilation_config
        self.model_runner = GPUModelRunner(
            model, device=self.device, dtype=mc.dtype, vocab_size=mc.get_vocab_size(),
            max_num_reqs=sc.max_num_seqs, max_num_tokens=sc.max_num_batched_tokens,
            max_model_len=mc.max_model_len, block_size=self.config.cache_config.block_size,
            cudagraph_capture_sizes=comp.decode_capture_sizes,
            mixed_capture_sizes=comp.mixed_capture_sizes,
            spec_decoder=spec_decode.make_spec_decoder(spec, mc.get_vocab_size(), self.device,
                                                       draft_model),
            async_scheduling=bool(sc.async_scheduling),
        )
        if self.model_runner.mm is not None:
            self.encoder = encoder_sizing(self.model_runner.mm, self.config, self.platform)
        if self.config.cache_config.enable_sleep_mode:
            driver = self.platform.get_vmm_driver(self.device.index or 0)
            self.weight_arena = WeightArena(model, driver)
            gc.collect()
            self.platform.empty_cache()  # the parameters' old storage
        self.startup_seconds["load_model"] = time.perf_counter() - t0
        logger.info("Model loaded: weights %.2f GiB (%s, %s) in %.1f s", self.weights_bytes / GiB,
                    mc.dtype, self.device, self.startup_seconds["load_model"])

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
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        runner = self.model_runner
        num_tokens, num_reqs = self._worst_case_batch()
        if self.encoder is not None:  # its cache held, its worst case in the peak below
            self.encoder_budget = self.encoder.reserve()
        logger.info("Profiling memory: a worst-case forward of %d tokens and the sampler over "
                    "%d sequences ...", num_tokens, max_num_seqs)
        with self.memory.measure_peak() as peak:
            if self.encoder_budget is not None:
                self.encoder.run_worst_case(self.encoder_budget.max_num_encoder_input_tokens)
            hidden = runner.warmup.dummy_run(num_tokens, num_reqs, with_kv=False)
            runner.warmup.dummy_sampler_run(hidden, max_num_seqs)
        spec_peak = spec_decode.profile_verify(runner, self.memory, hidden, max_num_seqs,
                                               self.config.speculative_config)
        self.spec_decode_peak = spec_peak.torch_peak
        del hidden
        profile = sizing.MemoryProfile(
            total=self.memory.total,
            weights=self.weights_bytes,
            encoder_cache=self.model_runner.mm.cache_bytes if self.model_runner.mm else 0,
            activation_peak=max(peak.torch_peak, spec_peak.torch_peak),
            non_torch=max(peak.non_torch_growth, spec_peak.non_torch_growth),
        )
        logger.info(
            "Memory profile: weights %.2f GiB, activation peak %.2f GiB, non-torch %.2f GiB "
            "(%d tokens, %d sequences)", profile.weights / GiB, profile.activation_peak / GiB,
            profile.non_torch / GiB, num_tokens, max_num_seqs,
        )
        return profile

    # --------------------------------------------------------------- KV cache
    @rpc
    def initialize_kv_cache(self) -> int:
        """Profile, then create and allocate the KV cache (classic: final; extensible: warmup).

        Returns:
            the number of blocks committed now (counting the null block).
        """
        t0 = time.perf_counter()
        self.profile = self._profile()
        self.kv_setup = KVCacheSetup(self.config, self.plan, self.platform, self.device,
                                     self.memory, self.world_size, self.agree_num_blocks)
        specs = self.model_runner.get_kv_cache_specs(self.config.model_config.dtype)
        self.kv_cache = self.kv_setup.allocate(specs, self.profile)
        self.model_runner.bind_kv_cache(self.kv_cache.views)
        if self.weight_arena is not None:
            self.sleep_state = SleepState(self.weight_arena, self.kv_cache, self.memory,
                                          self.platform)
        self.startup_seconds["initialize_kv_cache"] = time.perf_counter() - t0
        return self.kv_cache.committed_blocks

    def _agree_across_ranks(self, num_blocks: int) -> int:
        agreed, self.kv_cache_proposals = ranks.agree_on_num_blocks(
            self.world_size, self.rank, num_blocks)
        return agreed

    @rpc
    def kv_cache_agreement(self) -> list[int]:
        """Every rank's proposed block count at the last agreement, in rank order."""
        return list(self.kv_cache_proposals)

    # ----------------------------------------------------------------- warmup
    @rpc
    def compile_or_warm_up_model(self) -> int:
        """Warm up (worst-case prefill with KV, sampler), capture CUDA graphs, size, extend.

        Returns:
            the final number of KV blocks (counting the null block), the same on
            every rank (the elastic cache: its floor).
        """
        num_blocks = self._warm_up_and_size()
        self.platform.release_freed_host_memory()
        return num_blocks

    def _warm_up_and_size(self) -> int:
        t0 = time.perf_counter()
        self._warm_up()
        self.startup_seconds["warmup"] = time.perf_counter() - t0
        ranks.resync_random_state(self.world_size, self.config.model_config.seed)
        kv_cache = self.kv_cache
        if kv_cache.committed_blocks == kv_cache.capacity_blocks:
            # Fully committed (the classic cache, sized before warmup): nothing
            # to grow into, so nothing to measure.
            self._warm_up_last_step()
            return kv_cache.committed_blocks
        t0 = time.perf_counter()
        snapshot, size, num_blocks = self.kv_setup.size_after_warmup(kv_cache, self.profile)
        if self.plan.elastic_kv_cache:
            num_blocks = self._start_elastic(num_blocks)
        else:
            self.extend_kv_cache(num_blocks)
        self._warm_up_last_step()
        self.startup_seconds["extend"] = time.perf_counter() - t0
        self.kv_setup.log_final_size(snapshot, size, num_blocks, kv_cache, self._held_parts())
        return num_blocks

    def _warm_up(self) -> None:
        """Every shape and kernel serving will run, then graph capture (see the module doc)."""
        runner = self.model_runner
        num_tokens, num_reqs = self._worst_case_batch()
        logger.info("Warming up: a worst-case prefill of %d tokens with the KV cache, the "
                    "sampler%s ...", num_tokens,
                    f", then CUDA graph capture of {len(runner.cuda_graphs.capture_sizes)} decode "
                    f"sizes and mixed steps of {runner.mixed.graphs.capture_sizes} tokens"
                    if runner.use_cuda_graph else "")
        self._warmup_batch(num_tokens, num_reqs)
        # Every attention variant a request can select, compiled now rather
        # than while a user waits (issue 10).
        launches = runner.warmup.warm_up_kernels()
        # A one-token step: the small-batch kernels (norm / SiLU fused into the
        # projections, layers/fused_linear.py) that the worst case above does
        # not reach; CUDA-graph capture would compile them too, eager mode not.
        hidden = runner.warmup.dummy_run(1, 1, with_kv=True)
        runner.warmup.warm_up_logits(hidden, self.config.scheduler_config.max_num_seqs)
        del hidden
        if launches:
            logger.info("Attention kernels warmed up: %d variants", launches)
        if runner.use_cuda_graph:
            runner.warmup.capture_model()
            # torch.cuda.graph empties torch's cache when capture begins, so the
            # activation pool is gone; run the worst case once more so the pool
            # holds it again, in runtime's allocation pattern, before measuring.
            self._warmup_batch(num_tokens, num_reqs)
        self.memory.synchronize()

    def _warm_up_last_step(self) -> None:
        """One small step, the last thing before serving (CUDA only).

        On the H200 the first gather after start-up took 13.8 ms (the next
        0.16 ms) although warmup had run the same gather before the cache grew;
        the engine's first request paid it (SmolLM2 shape, issue 10). The cause
        inside CUDA is not known; a step here, on the final cache, removes it.
        """
        if self.platform.is_cuda_alike():
            runner = self.model_runner
            runner.warmup.warm_up_logits(runner.warmup.dummy_run(1, 1, with_kv=True), 1)

    def _warmup_batch(self, num_tokens: int, num_reqs: int) -> None:
        """Worst-case prefill with the KV cache, the sampler, the worst-case verify batch."""
        runner = self.model_runner
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        hidden = runner.warmup.dummy_run(num_tokens, num_reqs, with_kv=True)
        runner.warmup.dummy_sampler_run(hidden, max_num_seqs)
        if self.platform.is_cuda_alike():
            self._warm_up_long_prompts(num_tokens, num_reqs)
        positions = spec_decode.verify_positions(runner, max_num_seqs)
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
            runner.warmup.dummy_run(num_tokens, long_reqs, with_kv=True)

    def _held_parts(self) -> list[tuple[str, int]]:
        """What this rank holds besides the KV cache, for the sizing log line."""
        graphs = self.model_runner.cuda_graphs
        parts = [("weights", self.weights_bytes), ("activation peak", self.profile.activation_peak)]
        # The graph pool exists only where graphs were captured (not on CPU, not eager).
        if graphs.captured:
            parts.append(("CUDA graph pool", graphs.pool_bytes))
        if self.encoder_budget is not None:
            parts.append(("encoder cache", self.encoder_budget.cache_bytes))
        return parts

    def extend_kv_cache(self, num_blocks: int) -> None:
        """Commit the cache to `num_blocks` blocks under the same base and rebind the views.

        Grow-only; equal counts are a no-op. CUDA graphs captured before stay
        valid (same addresses).

        Raises:
            ValueError: past the capacity, below what is committed, or any
                change of a classic cache.
        """
        self.model_runner.bind_kv_cache(self.kv_cache.extend_kv_cache(num_blocks))

    # ----------------------------------------------------- the elastic cache
    def _start_elastic(self, limit: int) -> int:
        """Commit the elastic floor; `limit` (sized after warmup) bounds later growth."""
        block_size = self.config.cache_config.block_size
        per_request = -(-self.config.model_config.max_model_len // block_size)
        self.elastic = ElasticKVCache(
            self.kv_cache, self.memory, limit, per_request, agree=self.agree_num_blocks,
            thread_init=lambda: self.platform.init_device(self.device))
        floor = self.elastic.bounds.floor  # agreed across ranks
        self.extend_kv_cache(floor)
        self._bound_kv_blocks = floor  # the count the runner's views were last bound at
        logger.info(
            "Elastic KV cache: committed %.2f GiB (%d blocks) at start-up; grows while serving "
            "up to %d blocks, in chunks of %d blocks, into memory free at the time",
            self.kv_cache.committed_bytes / GiB, floor, limit, self.elastic.bounds.chunk,
        )
        return floor

    @rpc
    def elastic_kv_cache_bounds(self) -> ElasticBounds | None:
        """Floor, limit and chunk of the elastic cache; None when it is off."""
        return None if self.elastic is None else self.elastic.bounds

    @rpc
    def kv_cache_device(self) -> tuple[str, int]:
        """(the device's key for the elastic engines' registry, bytes of one KV block here)."""
        config = self.kv_cache.config
        return (self.platform.device_key(self.device.index or 0),
                config.block_stride * config.num_segments)

    @rpc
    def grow_kv_cache(self, num_blocks: int) -> tuple[int, list[int]]:
        """Commit up to `num_blocks` blocks where memory is free now.

        Returns:
            (the count reached, the counts below it where this rank's growth
            allocations end: where a shrink returns memory).
        """
        reached = self.elastic.grow(num_blocks)
        self.model_runner.bind_kv_cache(self.kv_cache.views)
        return reached, [e for e in self.elastic.piece_ends if e < reached]

    @rpc
    def grow_kv_cache_ahead(self, num_blocks: int) -> tuple[int, bool, list[int]]:
        """Commit up to `num_blocks` blocks on a helper thread (see `ElasticKVCache.grow_ahead`).

        Returns:
            (blocks usable now, their views bound; whether a growth is in flight;
            the allocation ends below that count, as `grow_kv_cache`).
        """
        reached, in_flight = self.elastic.grow_ahead(num_blocks)
        if reached != self._bound_kv_blocks:
            self.model_runner.bind_kv_cache(self.kv_cache.views)
            self._bound_kv_blocks = reached
        return reached, in_flight, [e for e in self.elastic.piece_ends if e < reached]

    @rpc
    def shrink_kv_cache(self, num_blocks: int) -> int:
        """Release the (free) tail blocks `num_blocks..`; returns the count kept."""
        self.memory.synchronize()
        kept = self.elastic.shrink(num_blocks)
        self.model_runner.bind_kv_cache(self.kv_cache.views)
        return kept

    @rpc
    def move_kv_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy KV blocks src[i] -> dst[i] and rename them in the runner's requests (the
        elastic cache moves in-use tail blocks down before releasing the tail)."""
        self.model_runner.move_kv_blocks(src, dst)

    @rpc
    def set_kv_cache_limit(self, limit_blocks: int | None) -> ElasticBounds:
        """A runtime ceiling for the elastic cache, blocks (None: the start-up limit).

        Raises:
            RuntimeError: the elastic cache is off. ValueError: a negative count.
        """
        if self.elastic is None:
            raise RuntimeError("a KV cache limit needs --enable-elastic-kv-cache")
        return self.elastic.set_limit(limit_blocks)

    # ------------------------------------------------------------- connectors
    @rpc
    def run_post_kv_cache_hooks(self) -> None:
        """The parts that need the final, committed cache: the KV connector registers it."""
        if self.config.kv_transfer_config is not None:
            self.kv_connector = WorkerKVConnector.create(self.config, self.kv_cache)

    @rpc
    def kv_connector_handshake(self) -> dict | None:
        """The worker-side connector's handshake metadata for its scheduler side."""
        return None if self.kv_connector is None else self.kv_connector.handshake()

    # ------------------------------------------------------------------ step
    @rpc
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        self.platform.adjust_threads()
        if self.kv_connector is not None:
            return self.kv_connector.execute(scheduler_output, self.model_runner.execute_model)
        return self.model_runner.execute_model(scheduler_output)

    @rpc
    def kv_cache_memory(self) -> KVCacheMemory:
        """Bytes committed and reserved, and committed blocks, for metrics."""
        if self.kv_cache is None:
            return KVCacheMemory(0, 0, 0)
        return self.kv_cache.memory()

    # ----------------------------------------------------------------- sleep
    @rpc
    def sleep(self, level: int) -> None:
        """Release weights' and KV cache's pages, keeping every address (see SleepState).

        Raises:
            RuntimeError: sleep mode is off. ValueError: a level other than 1 or 2.
        """
        if self.sleep_state is None:
            raise RuntimeError("sleep needs enable_sleep_mode=True and the extensible KV cache")
        if self.elastic is not None:
            self.elastic.wait_for_growth()  # no page may be mapped while they are released
        self.sleep_state.sleep(level, self.kv_connector)

    @rpc
    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Map fresh pages for "weights" and/or "kv_cache"; True when the weights must be
        reloaded (after a level-2 sleep). See `SleepState.wake_up` for the errors."""
        if self.sleep_state is None:
            raise RuntimeError("wake_up needs enable_sleep_mode=True")
        return self.sleep_state.wake_up(tags, self.kv_connector)

    @rpc
    def sleeping_tags(self) -> list[str]:
        """Which of "weights" / "kv_cache" are asleep now ([] without sleep mode)."""
        return [] if self.sleep_state is None else self.sleep_state.sleeping_tags()

    @rpc
    def reload_weights(self) -> None:
        """Load the checkpoint again into the (awake) parameters, in place."""
        from vllm.model_executor.model_loader import get_model_loader

        mc = self.config.model_config
        loader = get_model_loader(mc.load_format, mc.model_path)
        with torch.inference_mode(False), torch.no_grad():
            loader.load_weights(self.model_runner.model, mc.model_path)
        if self.weight_arena is not None:
            self.weight_arena.mark_loaded()

    # -------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        if self.elastic is not None:
            self.elastic.wait_for_growth()
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
