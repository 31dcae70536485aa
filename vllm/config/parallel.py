"""`ParallelConfig`: how the model is split across devices (one device today)."""

from __future__ import annotations

from dataclasses import dataclass

# The engine has no tensor-parallel model sharding yet; raise this when it does.
MAX_SUPPORTED_TENSOR_PARALLEL_SIZE = 1


@dataclass
class ParallelConfig:
    """How the model is split across devices.

    Attributes:
        tensor_parallel_size: devices the model is sharded over.

    Raises:
        ValueError: a size < 1, or > 1 (not supported yet).
    """

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > MAX_SUPPORTED_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size={tp} is not supported yet: this engine runs a model on "
                f"one device (at most {MAX_SUPPORTED_TENSOR_PARALLEL_SIZE})"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size
