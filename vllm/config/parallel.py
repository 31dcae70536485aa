"""`ParallelConfig`: how the model is split across devices, and which executor drives them."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.frozen import FrozenConfig

# --distributed-executor-backend choices (vLLM's names; "external_launcher" is not built).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DEFAULT_WORKER_CLS = "vllm.v1.worker.gpu_worker.Worker"


@dataclass
class ParallelConfig(FrozenConfig):
    """How the model is split across devices.

    Attributes:
        tensor_parallel_size: devices (ranks) the model is sharded over.
        distributed_executor_backend: "uni" (the worker in the engine process,
            one rank only), "mp" (one process per rank on this node) or "ray"
            (Ray actors, several nodes); None = vLLM's default, resolved by
            `resolve_executor_backend`: "uni" for one rank, "ray" when Ray is
            already initialised in this process or the ranks outnumber this
            node's devices, "mp" otherwise.
        worker_cls: the class each rank runs ("package.module.Class").

    Raises:
        ValueError: a size < 1 or an unknown backend.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_cls: str = DEFAULT_WORKER_CLS

    def __post_init__(self) -> None:
        if not isinstance(self.worker_cls, str) or "." not in self.worker_cls:
            raise ValueError(
                f"worker_cls must be 'package.module.Class', got {self.worker_cls!r}"
            )
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def resolve_executor_backend(self, local_device_count: int | None) -> None:
        """Pick the default backend and check the chosen one fits this node.

        Args:
            local_device_count: devices this node has (None: no limit, the CPU,
                where every rank is a process on the host).

        Raises:
            ValueError: "uni" with several ranks, "mp" with more ranks than
                local devices, or "ray" without Ray installed.
        """
        world = self.world_size
        fits_locally = local_device_count is None or world <= local_device_count
        backend = self.distributed_executor_backend
        if backend is None:
            if world == 1:
                backend = "uni"
            elif _ray_is_initialized() or not fits_locally:
                backend = "ray"
            else:
                backend = "mp"
        if backend == "uni" and world > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size={world} "
                "needs 'mp' (one node) or 'ray'"
            )
        if backend == "mp" and not fits_locally:
            raise ValueError(
                f"tensor_parallel_size={world} needs {world} devices, this node has "
                f"{local_device_count}; the 'mp' executor runs on one node: use "
                "--distributed-executor-backend ray across nodes"
            )
        if backend == "ray" and not _ray_is_installed():
            raise ValueError(
                "distributed_executor_backend 'ray' needs Ray, which is not installed: "
                "pip install 'vllm[ray]'"
            )
        self.distributed_executor_backend = backend


def _ray_is_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def _ray_is_initialized() -> bool:
    import sys

    ray = sys.modules.get("ray")  # never import Ray just to ask
    return ray is not None and ray.is_initialized()
