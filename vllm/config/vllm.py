"""`VllmConfig`: every config of one engine, validated and resolved once.

```
EngineArgs --create_engine_config()--> VllmConfig
                                        |- model_config        ModelConfig
                                        |- cache_config        CacheConfig
                                        |- scheduler_config    SchedulerConfig
                                        |- parallel_config     ParallelConfig
                                        |- compilation_config  CompilationConfig
                                        |- device_config       DeviceConfig
                                        |- kv_transfer_config  KVTransferConfig | None
                                        |- speculative_config  SpeculativeConfig | None
                                        '- multimodal_config   MultiModalConfig (images)
```

Each sub-config checks its own ranges when built; `__post_init__` here does
what needs several of them or the platform: scheduler defaults (device, context
length), CUDA graph sizes (max_num_seqs), the executor backend (ranks vs local
devices) with the check that the model splits over the ranks, one seed for
every rank, async scheduling. Then the whole configuration is frozen
(frozen.py): what start-up decides from the devices (the KV cache path, the
default gpu_memory_utilization it implies, the fitted max_model_len) is the
engine core's `StartupPlan` (startup.py), not a rewrite of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.device import DeviceConfig
from vllm.config.frozen import FrozenConfig
from vllm.config.kv_transfer import KNOWN_KV_CONNECTORS, KVTransferConfig
from vllm.config.model import ModelConfig
from vllm.config.multimodal import MultiModalConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.structured_outputs import StructuredOutputsConfig
from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class VllmConfig(FrozenConfig):
    """All of one engine's configuration; leaf classes take plain values from it.

    Raises:
        ValueError: cross-field conflicts.
    """

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    kv_transfer_config: KVTransferConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)

    def __post_init__(self) -> None:
        from vllm import platforms

        platform = platforms.current_platform
        platform.verify_environment()
        self.scheduler_config.resolve(self.model_config.max_model_len, platform.device_type)
        self.compilation_config.resolve(
            self.scheduler_config.max_num_seqs, graphs_supported=platform.is_cuda_alike(),
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens)
        self._check_kv_connector_named()
        self._resolve_parallel(platform)
        spec = self.speculative_config
        if spec is not None and spec.num_speculative_tokens >= self.model_config.max_model_len:
            raise ValueError(
                f"speculative_config: num_speculative_tokens ({spec.num_speculative_tokens}) "
                f"must be below max_model_len ({self.model_config.max_model_len}): a "
                "request's drafts and the token they follow must fit its context"
            )
        if spec is not None and spec.method == "draft_model" and (
            self.parallel_config.world_size > 1
        ):
            raise ValueError(
                "speculative_config: method 'draft_model' runs on one rank only "
                f"(tensor_parallel_size={self.parallel_config.tensor_parallel_size})"
            )
        if (spec is not None or self.kv_transfer_config is not None) and (
                self.model_config.is_multimodal_model):
            raise ValueError(
                f"{'speculative_config' if spec is not None else 'kv_transfer_config'} is "
                "not supported with a multimodal model yet (its steps carry image rows "
                "and M-RoPE positions that drafts and KV transfers do not)")
        self._check_kv_transfer()
        self._resolve_async_scheduling(platform)
        self._warn_multimodal_flags_unused()
        self._freeze_all()

    def _freeze_all(self) -> None:
        """Nothing rewrites the configuration once it is built (frozen.py)."""
        for f in dataclasses.fields(self):
            part = getattr(self, f.name)
            if isinstance(part, FrozenConfig):
                part.freeze()
        self.freeze()

    def _warn_multimodal_flags_unused(self) -> None:
        """Image flags on a text-only model: accepted, as current vLLM accepts them (older
        releases refused --limit-mm-per-prompt), and said to have no effect, not silently."""
        given = self.multimodal_config.flags_given
        if given and not self.model_config.is_multimodal_model:
            archs = getattr(self.model_config.hf_config, "architectures", None) or ["?"]
            logger.warning("%s %s accepted and %s no effect: the model (%s) is text-only "
                           "and takes no images", ", ".join(given),
                           "is" if len(given) == 1 else "are",
                           "has" if len(given) == 1 else "have", archs[0])

    def _check_kv_connector_named(self) -> None:
        """An empty kv_transfer_config means no connector (as in vLLM); one that sets
        a role or options without naming a connector is refused, never ignored."""
        kv = self.kv_transfer_config
        if kv is None or kv.kv_connector:
            return
        if kv.kv_role is not None or kv.kv_connector_extra_config:
            raise ValueError(
                f"kv_transfer_config sets kv_role {kv.kv_role!r} but names no kv_connector "
                f"(one of {', '.join(sorted(KNOWN_KV_CONNECTORS))}): nothing would be "
                "transferred"
            )
        self.kv_transfer_config = None

    def _check_kv_transfer(self) -> None:
        check_kv_transfer_combination(self.kv_transfer_config, self.parallel_config,
                                      self.cache_config, self.speculative_config)

    def _resolve_parallel(self, platform) -> None:
        """Executor backend, model split check, and one seed shared by every rank."""
        parallel = self.parallel_config
        parallel.resolve_executor_backend(
            platform.device_count() if platform.is_cuda_alike() else None
        )
        self.model_config.verify_with_parallel_config(parallel)
        if parallel.world_size > 1 and self.model_config.seed is None:
            # Every rank samples from the same logits with its own generator:
            # unseeded, they would pick different tokens and diverge. One seed
            # drawn here reaches all of them with the config.
            import random

            self.model_config.seed = random.SystemRandom().randrange(2**31)

    def _resolve_async_scheduling(self, platform) -> None:
        sched, kv = self.scheduler_config, self.kv_transfer_config
        sched.async_scheduling = resolve_async_scheduling(
            sched.async_scheduling, self.parallel_config.distributed_executor_backend,
            speculative=None if self.speculative_config is None else (
                self.speculative_config.method),
            kv_connector=None if kv is None else kv.kv_connector,
            cuda_alike=platform.is_cuda_alike(),
        )

    def summary(self) -> str:
        """One line for the engine's start-up log."""
        m, c, s = self.model_config, self.cache_config, self.scheduler_config
        kv_path = {None: "auto", True: "extensible", False: "classic"}[
            c.enable_extensible_kv_cache]
        return (
            f"model={m.model!r}, dtype={m.dtype}, max_model_len={m.max_model_len}, "
            f"load_format={m.load_format}, seed={m.seed}, device={self.device_config.device_type}, "
            f"kv_cache={kv_path}, block_size={c.block_size}, "
            f"gpu_memory_utilization={c.gpu_memory_utilization}, "
            f"kv_cache_memory_bytes={c.kv_cache_memory_bytes}, "
            f"enable_prefix_caching={c.enable_prefix_caching}, max_num_seqs={s.max_num_seqs}, "
            f"max_num_batched_tokens={s.max_num_batched_tokens}, "
            f"max_num_partial_prefills={s.max_num_partial_prefills}, "
            f"max_long_partial_prefills={s.max_long_partial_prefills}, "
            f"long_prefill_token_threshold={s.long_prefill_token_threshold}, "
            f"async_scheduling={s.async_scheduling}, "
            f"cudagraphs={self.compilation_config.use_cudagraph}, "
            f"speculative_config={self.speculative_config}, "
            f"tensor_parallel_size={self.parallel_config.tensor_parallel_size}, "
            f"distributed_executor_backend={self.parallel_config.distributed_executor_backend}"
        )


def resolve_async_scheduling(
    asked: bool | None, backend: str, *, speculative: str | None, kv_connector: str | None,
    cuda_alike: bool,
) -> bool:
    """Async scheduling on where it is correct and pays; off, with a log line, elsewhere.

    It needs the worker in the engine process (the uni executor: the
    sampled ids stay on the device between steps, and the output of a step
    is a handle that is resolved later, which no RPC can carry). With n-gram
    speculative decoding the drafts are proposed and fed on the device
    (docs/design.md, "Speculative decoding and async scheduling"); not built
    with a draft model (its drafts come from its own forward per step) or a
    KV connector (it saves and loads around each step's finished requests).
    With n-gram drafts it is the default too: correct on an H100
    (tests/v1/spec_decode/test_spec_decode_cuda.py) and faster per token than
    the synchronous spec path on every prompt of benchmarks/benchmark_spec_decode.py
    (H100, 2026-12-07: 10-19 % on the three prompts with equal text; docs/benchmarks.md,
    "Speculative decoding: what 2x needs"). On the CPU nothing runs while Python
    prepares the next step, so it only costs.

    Args:
        asked: the user's `async_scheduling` (None: the default).
        backend: the resolved executor backend.
        speculative: the speculative method configured ("ngram",
            "draft_model"), or None.
        kv_connector: the configured KV connector's name, if any.
        cuda_alike: the platform is CUDA or ROCm.
    """
    unsupported = None
    if backend != "uni":
        unsupported = f"the {backend!r} executor (it needs 'uni': one rank, in-process)"
    elif speculative not in (None, "ngram"):
        unsupported = f"speculative decoding with method {speculative!r} (speculative_config)"
    elif kv_connector is not None:
        unsupported = f"a KV connector ({kv_connector})"
    if asked is None:
        if unsupported is not None and cuda_alike:  # the default would have been on
            logger.info("async scheduling off: not supported with %s", unsupported)
        return unsupported is None and cuda_alike
    if asked and unsupported is not None:
        logger.warning("async scheduling is not supported with %s; "
                       "falling back to synchronous scheduling", unsupported)
        return False
    return bool(asked)


def check_kv_transfer_combination(kv: KVTransferConfig | None, parallel: ParallelConfig,
                                  cache: CacheConfig, spec: SpeculativeConfig | None) -> None:
    """Refuse the combinations a KV connector cannot serve correctly yet (one clear line).

    Needs no model, so `EngineArgs.validate` runs it before any process starts.

    Raises:
        ValueError: a connector with several ranks, the elastic cache or
            speculative decoding.
    """
    if kv is None or not kv.kv_connector:
        return
    if parallel.world_size > 1:
        raise ValueError(
            f"kv_transfer_config ({kv.kv_connector}) works with one rank only for now; "
            f"tensor_parallel_size={parallel.tensor_parallel_size} would need "
            "every rank's worker side to transfer its shard"
        )
    if cache.enable_elastic_kv_cache:
        raise ValueError(
            f"kv_transfer_config ({kv.kv_connector}) cannot be combined with "
            "enable_elastic_kv_cache yet: the connector registers the committed KV "
            "memory once, and the elastic cache commits and releases it while serving"
        )
    if spec is not None:
        raise ValueError(
            f"kv_transfer_config ({kv.kv_connector}) cannot be combined with "
            "speculative_config yet: drafts' KV slots are rolled back after "
            "verification, and the connectors save and load only settled blocks"
        )
