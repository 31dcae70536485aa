"""`CacheConfig`: the KV cache's block size, sizing knobs and which path the user asked for.

What the engine then does about the path (the VMM probe of every rank, the
default `gpu_memory_utilization` it implies) is decided once at start-up, in
`StartupPlan` (startup.py); this config keeps the user's values as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.frozen import FrozenConfig

# Block sizes the attention backends accept: Triton's tl.arange needs a power
# of two; 256 bounds the per-block work. Covers vLLM's choices (1, 8 ... 128).
MAX_BLOCK_SIZE = 256


@dataclass
class CacheConfig(FrozenConfig):
    """KV cache settings (read-only once the engine's `VllmConfig` is built).

    Attributes:
        block_size: tokens per KV block; a power of two in [1, 256].
        gpu_memory_utilization: fraction of *total* device memory the engine
            may use, in (0, 1]; None = the path's default (1.0 extensible,
            0.92 classic), chosen by `StartupPlan`.
        kv_cache_memory_bytes: explicit KV cache size in bytes (> 0) on either
            path; bypasses the measured / profiled sizing.
        enable_prefix_caching: reuse KV blocks across requests with a shared prefix.
        enable_extensible_kv_cache: None = on where every rank's VMM probe
            passes, True = required, False = classic path (`StartupPlan`).
        enable_sleep_mode: allow `sleep()` / `wake_up()` (needs the extensible cache).
        enable_elastic_kv_cache: commit KV blocks while serving as they are
            needed and release free tail blocks when idle (docs/elastic_kv_cache.md);
            requires the extensible cache.

    Raises:
        ValueError: a value outside its range (names the field and range), or
            a combination that can never work (sleep or elastic without the
            extensible cache).
    """

    block_size: int = 16
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_extensible_kv_cache: bool | None = None
    enable_sleep_mode: bool = False
    enable_elastic_kv_cache: bool = False

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
        if self.enable_extensible_kv_cache is False:
            for flag, on in (("enable_elastic_kv_cache (--enable-elastic-kv-cache)",
                              self.enable_elastic_kv_cache),
                             ("enable_sleep_mode", self.enable_sleep_mode)):
                if on:
                    raise ValueError(f"{flag} needs the extensible KV cache; drop "
                                     "--no-enable-extensible-kv-cache")

    @property
    def gpu_memory_utilization_explicit(self) -> bool:
        """Whether the user set gpu_memory_utilization (else the path's default applies)."""
        return self.gpu_memory_utilization is not None
