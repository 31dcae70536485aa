"""`StartupPlan`: what an engine's start-up decided from its configuration and its devices.

The configuration says what the user asked for and is read-only once built;
the plan says what this engine does about it, decided once by the engine core
and logged once:

```
 VllmConfig (frozen)  +  every rank's VMM probe (Worker.probe_kv_cache_path)
          |  StartupPlan.decide(cache_config, probes)
          v
 StartupPlan(extensible_kv_cache, reason, gpu_memory_utilization, ...)
          |  -> every worker (Worker.load_model(plan)): sizing, sharing check
          |  workers size, warm up, agree on a block count
          v
 plan.with_kv_cache(num_blocks, max_model_len)  -> the scheduler, the frontend
```

The KV cache path:

| enable_extensible_kv_cache | every rank's probe | path                                    |
|----------------------------|--------------------|-----------------------------------------|
| None (default)             | passes             | extensible                              |
| None                       | one fails          | classic, one INFO line with the reason  |
| True (or elastic)          | one fails          | `ValueError` with the reason            |
| False                      | not asked          | classic                                 |

An unset `gpu_memory_utilization` then means 1.0 (extensible: sizing is
measured after warmup, no hidden margin) or 0.92 (classic: vLLM's margin for
what it cannot measure before allocating). Sleep mode needs the extensible
path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.config.cache import CacheConfig
from vllm.logger import init_logger

logger = init_logger(__name__)

# Left unset, gpu_memory_utilization resolves per path. The extensible path
# measures what is free after warmup and CUDA graph capture, so it needs no
# hidden margin: 1.0 (its explicit post-warmup buffer lives in the sizing code).
# The classic path sizes the cache before graphs, workspaces and NCCL buffers
# exist and must leave room for them by guessing: 0.92.
DEFAULT_GPU_MEMORY_UTILIZATION_EXTENSIBLE = 1.0
DEFAULT_GPU_MEMORY_UTILIZATION_CLASSIC = 0.92


@dataclass(frozen=True)
class StartupPlan:
    """An engine's start-up decisions (see the module docstring).

    Attributes:
        extensible_kv_cache: the KV cache reserves its capacity and grows
            (True), or is one classic allocation (False).
        reason: why the extensible cache is off though it was not turned off
            (the failing probes, "rank r: ..." with several ranks), else None.
        gpu_memory_utilization: the share of the device the engine may hold:
            the user's value, or the path's default.
        gpu_memory_utilization_explicit: whether the user set it (a device
            shared with another process is refused on a default).
        elastic_kv_cache: the committed size moves while serving.
        num_blocks: KV blocks (counting the null block) once sized; 0 before.
        max_model_len: tokens one request may hold, fitted to the KV cache; 0 before.
        encoder_budget: image tokens the vision encoder computes per step, as
            reserved by warmup (0: a text-only model); encoder_cache_size: image
            tokens of encoder output kept; encoder_cache_bytes: its memory.
    """

    extensible_kv_cache: bool
    reason: str | None
    gpu_memory_utilization: float
    gpu_memory_utilization_explicit: bool
    elastic_kv_cache: bool = False
    num_blocks: int = 0
    max_model_len: int = 0
    encoder_budget: int = 0
    encoder_cache_size: int = 0
    encoder_cache_bytes: int = 0

    @classmethod
    def decide(cls, cache: CacheConfig, probes: Sequence[str | None]) -> StartupPlan:
        """The KV cache path and the utilization it implies.

        Args:
            cache: the engine's cache configuration.
            probes: each rank's VMM probe result, in rank order (None = the
                device can hold the extensible cache, else the reason it
                cannot); not consulted when the extensible cache is off.

        Raises:
            ValueError: the extensible cache was required (True, or implied by
                elastic) and a rank cannot hold it, or sleep mode needs it and
                it is off; the message carries the probes' reasons.
        """
        requested = cache.enable_extensible_kv_cache
        reason = None if requested is False else _failures(probes)
        if reason is not None and requested is True:
            raise ValueError(
                "enable_extensible_kv_cache=True (--enable-extensible-kv-cache) cannot be "
                f"honoured: {reason}. Leave it unset to fall back to the classic KV cache, or "
                "pass --no-enable-extensible-kv-cache."
            )
        if reason is not None and cache.enable_elastic_kv_cache:
            raise ValueError(
                "enable_elastic_kv_cache=True (--enable-elastic-kv-cache) needs the extensible "
                f"KV cache, which cannot be honoured here: {reason}"
            )
        extensible = requested is not False and reason is None
        if requested is None and reason is not None:
            logger.info("Extensible KV cache unavailable (%s); using the classic KV cache.",
                        reason)
        if cache.enable_sleep_mode and not extensible:
            raise ValueError("enable_sleep_mode needs the extensible KV cache, which is off "
                             f"here ({reason or 'enable_extensible_kv_cache=False'})")
        util = cache.gpu_memory_utilization
        if util is None:
            util = (DEFAULT_GPU_MEMORY_UTILIZATION_EXTENSIBLE if extensible
                    else DEFAULT_GPU_MEMORY_UTILIZATION_CLASSIC)
        return cls(
            extensible_kv_cache=extensible, reason=reason, gpu_memory_utilization=util,
            gpu_memory_utilization_explicit=cache.gpu_memory_utilization is not None,
            elastic_kv_cache=cache.enable_elastic_kv_cache,
        )

    def with_kv_cache(self, num_blocks: int, max_model_len: int) -> StartupPlan:
        """The plan once the workers agreed on `num_blocks` and max_model_len fits it."""
        return dataclasses.replace(self, num_blocks=num_blocks, max_model_len=max_model_len)

    def with_encoder(self, budget: int, cache_size: int, cache_bytes: int) -> StartupPlan:
        """The plan with what warmup reserved for the vision encoder."""
        return dataclasses.replace(self, encoder_budget=budget, encoder_cache_size=cache_size,
                                   encoder_cache_bytes=cache_bytes)

    @property
    def kv_cache_path(self) -> str:
        return "extensible" if self.extensible_kv_cache else "classic"

    def describe(self) -> str:
        """One line for the log."""
        parts = [f"kv_cache={self.kv_cache_path}"
                 + (" (elastic)" if self.elastic_kv_cache else ""),
                 f"gpu_memory_utilization={self.gpu_memory_utilization:g}"
                 + ("" if self.gpu_memory_utilization_explicit else " (default)")]
        if self.num_blocks:
            parts += [f"num_blocks={self.num_blocks}", f"max_model_len={self.max_model_len}"]
        if self.encoder_budget:
            parts.append(f"encoder_budget={self.encoder_budget} tokens, encoder_cache="
                         f"{self.encoder_cache_size} tokens "
                         f"({self.encoder_cache_bytes / 2**30:.2f} GiB)")
        if self.reason:
            parts.append(f"classic because {self.reason}")
        return ", ".join(parts)


def _failures(probes: Sequence[str | None]) -> str | None:
    """The failing probes as one reason ("rank r: ..." with several ranks), None if none."""
    if len(probes) == 1:
        return probes[0]
    failed = [f"rank {rank}: {why}" for rank, why in enumerate(probes) if why]
    return "; ".join(failed) or None
