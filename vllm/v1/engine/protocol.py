"""What a frontend and the engine core say to each other (torch-free).

```
 frontend                                         engine core (EngineCoreProc)
    ADD (Request) / ABORT / FINISH_STOPPED (ids) ---->  scheduler
    UTILITY (call id, method name, args)         ---->  EngineCore.<method>(*args)
    SHUTDOWN                                     ---->  leave the loop
    <---- OUTPUTS (EngineCoreOutputs: one step's outputs, failed ids, figures)
    <---- RESULT  (call id, ok, value | RemoteFailure)
```

`EngineCoreUtilities` is the one list of the calls a frontend may make besides
the request flow: `EngineCore` implements it (the offline `LLMEngine` calls it
directly), the server's client names one of its methods
(`await client.call(EngineCoreUtilities.sleep, 1)`), and the engine core
process refuses any name it does not declare.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.v1.core.sched.stats import SchedulerStats
    from vllm.v1.outputs import EngineCoreOutput, KVCacheMemory


class EngineCoreRequestType(enum.Enum):
    """What a message from the frontend asks of the engine core."""

    ADD = "add"  # payload: a Request
    ABORT = "abort"  # payload: request ids
    FINISH_STOPPED = "finish_stopped"  # payload: request ids that matched a stop string
    UTILITY = "utility"  # payload: (call id, method name, args)
    SHUTDOWN = "shutdown"  # payload: None


class EngineCoreReplyType(enum.Enum):
    """What a message from the engine core carries."""

    OUTPUTS = "outputs"  # payload: EngineCoreOutputs
    RESULT = "result"  # payload: (call id, ok, value or RemoteFailure)


@dataclass
class EngineCoreOutputs:
    """One batch from the engine core: a step's results, or figures after a change.

    Attributes:
        outputs: the EngineCoreOutput of each request that produced something.
        failed: ids of requests the engine failed (aborted in the core), with `error`.
        error: why they failed ("the engine step failed: ...").
        scheduler_stats: the scheduler's figures after the step (for /metrics).
        kv_memory: the KV cache's committed / reserved bytes after the step.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    error: str | None = None
    scheduler_stats: SchedulerStats | None = None
    kv_memory: KVCacheMemory | None = None


class EngineCoreUtilities(Protocol):
    """The engine core's calls besides the request flow (`EngineCore` implements them)."""

    def sleep(self, level: int = 1) -> None:
        """Abort everything held, release weights' and KV cache's device memory."""

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Map memory back; True when the weights must be reloaded (level-2 sleep)."""

    def is_sleeping(self) -> bool:
        """Whether any rank has weights or KV cache asleep."""

    def reload_weights(self) -> None:
        """Load the checkpoint into the model again (after a level-2 sleep)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False while a request holds blocks."""

    def get_stats(self) -> SchedulerStats:
        """The scheduler's figures now."""

    def kv_cache_memory(self) -> KVCacheMemory:
        """Committed / reserved bytes and committed blocks of the KV cache."""

    def set_kv_cache_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling for the elastic KV cache (None: the start-up one), in blocks."""


UTILITY_METHODS = frozenset(
    name for name, value in vars(EngineCoreUtilities).items()
    if callable(value) and not name.startswith("_")
)


def utility_name(method: Any) -> str:
    """The name of an `EngineCoreUtilities` method, checked.

    Raises:
        ValueError: `method` is not one of the protocol's methods.
    """
    name = getattr(method, "__name__", None)
    if name not in UTILITY_METHODS or getattr(EngineCoreUtilities, name) is not method:
        raise ValueError(f"{method!r} is not an EngineCoreUtilities method")
    return name
