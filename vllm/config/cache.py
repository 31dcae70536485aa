"""`CacheConfig`: the KV cache's block size, sizing knobs and which path sizes it.

The extensible tri-state and the default `gpu_memory_utilization` are resolved
here, in `resolve_kv_cache_path`, and nowhere else (DESIGN.md section 5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.logger import init_logger

logger = init_logger(__name__)

# Left unset, gpu_memory_utilization resolves per path. The extensible path
# measures what is free after warmup and CUDA graph capture, so it needs no
# hidden margin: 1.0 (its explicit post-warmup buffer lives in the sizing code).
# The classic path sizes the cache before graphs, workspaces and NCCL buffers
# exist and must leave room for them by guessing: 0.92.
DEFAULT_GPU_MEMORY_UTILIZATION_EXTENSIBLE = 1.0
DEFAULT_GPU_MEMORY_UTILIZATION_CLASSIC = 0.92
# Block sizes the attention backends accept: Triton's tl.arange needs a power
# of two; 256 bounds the per-block work. Covers vLLM's choices (1, 8 ... 128).
MAX_BLOCK_SIZE = 256


@dataclass
class CacheConfig:
    """KV cache settings.

    Attributes:
        block_size: tokens per KV block; a power of two in [1, 256].
        gpu_memory_utilization: fraction of *total* device memory the engine
            may use, in (0, 1]; None = the path's default (1.0 extensible,
            0.92 classic), resolved by `resolve_kv_cache_path`.
        kv_cache_memory_bytes: explicit KV cache size in bytes (> 0) on either
            path; bypasses the measured / profiled sizing.
        enable_prefix_caching: reuse KV blocks across requests with a shared prefix.
        enable_extensible_kv_cache: None = on where the platform's VMM probe
            passes, True = required, False = classic path. A bool once resolved.
        enable_sleep_mode: allow `sleep()` / `wake_up()` (needs the extensible cache).
        enable_elastic_kv_cache: commit KV blocks while serving as they are
            needed and release free tail blocks when idle (docs/elastic_kv_cache.md);
            implies (requires) the extensible cache.
        gpu_memory_utilization_explicit: whether the user set
            gpu_memory_utilization (the foreign-process check refuses to share
            a device on a default; not an argument).
        extensible_kv_cache_unavailable_reason: the VMM probe's reason when it
            failed, else None (not an argument).

    Raises:
        ValueError: a value outside its range (names the field and range).
    """

    block_size: int = 16
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_extensible_kv_cache: bool | None = None
    enable_sleep_mode: bool = False
    enable_elastic_kv_cache: bool = False
    gpu_memory_utilization_explicit: bool = field(init=False)
    extensible_kv_cache_unavailable_reason: str | None = field(init=False, default=None)
    kv_cache_path_resolved: bool = field(init=False, default=False, repr=False)
    extensible_kv_cache_required: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        bs = self.block_size
        if (not isinstance(bs, int) or isinstance(bs, bool) or not 1 <= bs <= MAX_BLOCK_SIZE
                or bs & (bs - 1)):
            raise ValueError(
                f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {bs!r}"
            )
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, int | float)
                                 or not 0.0 < util <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        kvb = self.kv_cache_memory_bytes
        if kvb is not None and (not isinstance(kvb, int) or isinstance(kvb, bool) or kvb <= 0):
            raise ValueError(f"kv_cache_memory_bytes must be an int > 0 (bytes), got {kvb!r}")
        if self.enable_extensible_kv_cache not in (None, True, False):
            raise ValueError(
                "enable_extensible_kv_cache must be None (auto), True or False, "
                f"got {self.enable_extensible_kv_cache!r}"
            )
        if not isinstance(self.enable_elastic_kv_cache, bool):
            raise ValueError(
                f"enable_elastic_kv_cache must be a bool, got {self.enable_elastic_kv_cache!r}"
            )
        if self.enable_elastic_kv_cache:
            if self.enable_extensible_kv_cache is False:
                raise ValueError(
                    "enable_elastic_kv_cache (--enable-elastic-kv-cache) needs the extensible "
                    "KV cache; drop --no-enable-extensible-kv-cache"
                )
            self.enable_extensible_kv_cache = True  # implied, hence required
        self.gpu_memory_utilization_explicit = util is not None

    def resolve_kv_cache_path(self, vmm_probe: Callable[[], str | None]) -> None:
        """Decide the KV cache path and the default utilization, once.

        Args:
            vmm_probe: the platform VMM driver's `probe()`: None when usable,
                else the reason it is not. Called only when the extensible
                cache is not explicitly off.

        Afterwards `enable_extensible_kv_cache` is a bool and
        `gpu_memory_utilization` a float. A second call is a no-op.

        Raises:
            ValueError: the extensible cache was required (True) but the probe
                failed, or sleep mode was asked for without it; the message
                carries the probe's reason.
        """
        if self.kv_cache_path_resolved:
            return
        requested = self.enable_extensible_kv_cache
        reason = None if requested is False else vmm_probe()
        if requested is True and reason is not None:
            raise ValueError(
                "enable_extensible_kv_cache=True (--enable-extensible-kv-cache) cannot be "
                f"honoured: {reason}. Leave it unset to fall back to the classic KV cache, "
                "or pass --no-enable-extensible-kv-cache."
            )
        if requested is None and reason is not None:
            logger.info("Extensible KV cache unavailable (%s); using the classic KV cache.", reason)
        extensible = reason is None if requested is None else requested
        self.extensible_kv_cache_required = requested is True
        self._set_kv_cache_path(extensible, reason)
        self.kv_cache_path_resolved = True

    def fall_back_to_classic(self, reason: str) -> None:
        """Take the classic path after all: a rank's device cannot hold the extensible cache.

        Raises:
            ValueError: the extensible cache was required, or sleep mode needs it;
                the message carries `reason` (which names the rank).
        """
        if not self.enable_extensible_kv_cache:
            return
        if self.extensible_kv_cache_required:
            raise ValueError(
                "enable_extensible_kv_cache=True (--enable-extensible-kv-cache) cannot be "
                f"honoured: {reason}"
            )
        logger.info("Extensible KV cache unavailable (%s); using the classic KV cache.", reason)
        if not self.gpu_memory_utilization_explicit:
            self.gpu_memory_utilization = None  # the default follows the path again
        self._set_kv_cache_path(False, reason)

    def _set_kv_cache_path(self, extensible: bool, reason: str | None) -> None:
        if self.enable_sleep_mode and not extensible:
            why = reason or "enable_extensible_kv_cache=False"
            raise ValueError(
                f"enable_sleep_mode needs the extensible KV cache, which is off here ({why})"
            )
        self.enable_extensible_kv_cache = extensible
        self.extensible_kv_cache_unavailable_reason = reason
        if self.gpu_memory_utilization is None:
            # The one place the default is chosen (and restored on fallback).
            self.gpu_memory_utilization = (
                DEFAULT_GPU_MEMORY_UTILIZATION_EXTENSIBLE
                if extensible
                else DEFAULT_GPU_MEMORY_UTILIZATION_CLASSIC
            )
