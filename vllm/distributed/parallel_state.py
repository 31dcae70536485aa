"""Process groups of one engine over torch.distributed: the world and the tensor-parallel group.

Every worker process calls, in this order (the worker's `init_device` does):

    init_distributed_environment(world_size, rank, distributed_init_method, local_rank)
    initialize_model_parallel(tensor_model_parallel_size)
        ...   get_tp_group().all_reduce(x)  (the parallel layers)
    destroy_model_parallel(); destroy_distributed_environment()   (shutdown)

    world:  ranks 0 .. world_size-1           (one process per device)
    tp:     [0 .. tp-1] [tp .. 2tp-1] ...     (consecutive ranks; today world == tp)

Each group has two torch.distributed groups over the same ranks: `device_group`
on the platform's backend (NCCL on CUDA and ROCm, gloo on the CPU) for tensors
on the device, and `cpu_group` (always gloo) for small host-side agreements
(an int minimum, a Python object), so those never touch the device or an NCCL
communicator. On the CPU the two are one gloo group.

Single-rank engines never call any of this: layers built with tp_size == 1
run no collective, and `get_tp_group()` is then not needed.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm.logger import init_logger

logger = init_logger(__name__)

# How long a collective (and the rendezvous) may wait for a peer before it
# fails instead of hanging: a rank that died mid-step otherwise leaves the
# others blocked in all_reduce forever. torch's own default is 10 min (30 for
# NCCL); the executor notices a dead process within seconds, so this is only
# the backstop for a peer that hangs while alive.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class GroupCoordinator:
    """A group of ranks and the collectives the engine runs over it.

    Attributes:
        ranks: global ranks of the group, in group order.
        rank: this process's global rank.
        rank_in_group: this process's index in `ranks`.
        device_group: torch.distributed group on the platform backend (tensors on the device).
        cpu_group: gloo group over the same ranks (host tensors and Python objects).
    """

    name: str
    ranks: list[int]
    rank: int
    device_group: Any
    cpu_group: Any

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x` (identity for one rank)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in group order (same shape on all ranks)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in group order (over the gloo group)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """The group rank `src`'s `obj` on every rank (over the gloo group)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        groups = {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}
        for group in groups.values():
            with contextlib.suppress(Exception):  # a peer may already be gone
                dist.destroy_process_group(group)
        self.device_group = self.cpu_group = None


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def _backend_default() -> str:
    from vllm.platforms import current_platform

    return current_platform.dist_backend


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    local_rank: int = 0,
    backend: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> GroupCoordinator:
    """Join the engine's world (blocks until all `world_size` ranks have joined).

    Args:
        world_size: processes in the engine (tensor-parallel size today).
        rank: this process's global rank in [0, world_size).
        distributed_init_method: rendezvous URL, e.g. "tcp://10.0.0.1:29500"
            (the executor picks one on rank 0's node).
        local_rank: device index on this node (CUDA device to bind NCCL to).
        backend: "nccl" or "gloo"; None = the platform's (`Platform.dist_backend`).
        timeout: how long the rendezvous and each collective may wait for a peer.

    Raises:
        ValueError: rank outside [0, world_size).
        RuntimeError: already initialized with a different world.
    """
    global _WORLD
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    backend = backend or _backend_default()
    if _WORLD is not None:
        if _WORLD.world_size != world_size or _WORLD.rank != rank:
            raise RuntimeError(
                f"distributed environment already initialized as rank {_WORLD.rank} of "
                f"{_WORLD.world_size}; asked for rank {rank} of {world_size}"
            )
        return _WORLD
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            # Binding the NCCL communicator to this rank's device up front
            # avoids a guess (and a context on device 0) at the first collective.
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(
            backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
            **kwargs,
        )
    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo") if backend != "gloo" else dist.group.WORLD
    _WORLD = GroupCoordinator("world", ranks, rank, dist.group.WORLD, cpu_group)
    logger.info(
        "Rank %d of %d joined (backend %s, local rank %d)", rank, world_size, backend, local_rank
    )
    return _WORLD


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> GroupCoordinator:
    """Create the tensor-parallel groups: consecutive runs of `tensor_model_parallel_size` ranks.

    Every rank must call this (torch.distributed creates groups collectively).

    Raises:
        RuntimeError: the world is not initialized, or the size does not divide it.
    """
    global _TP
    world = get_world_group()
    tp = tensor_model_parallel_size
    if tp < 1 or world.world_size % tp:
        raise RuntimeError(
            f"tensor_parallel_size {tp} does not divide the world size {world.world_size}"
        )
    if _TP is not None:
        if _TP.world_size != tp:
            raise RuntimeError(
                f"the tensor-parallel group already has {_TP.world_size} ranks, not {tp}"
            )
        return _TP
    backend = dist.get_backend(world.device_group)
    mine = None
    for start in range(0, world.world_size, tp):
        ranks = list(range(start, start + tp))
        if tp == world.world_size:
            device_group, cpu_group = world.device_group, world.cpu_group
        else:
            device_group = dist.new_group(ranks, backend=backend)
            cpu_group = device_group if backend == "gloo" else dist.new_group(ranks, "gloo")
        if world.rank in ranks:
            mine = GroupCoordinator("tp", ranks, world.rank, device_group, cpu_group)
    _TP = mine
    return _TP


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError("the distributed environment is not initialized "
                           "(init_distributed_environment was not called)")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError("the tensor-parallel group is not initialized "
                           "(initialize_model_parallel was not called)")
    return _TP


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group (0 when not initialized)."""
    return _TP.rank_in_group if _TP is not None else 0


def get_tensor_model_parallel_world_size() -> int:
    """Ranks in the tensor-parallel group (1 when not initialized)."""
    return _TP.world_size if _TP is not None else 1


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None and _WORLD is not None and _TP.device_group is not _WORLD.device_group:
        _TP.destroy()
    _TP = None


def destroy_distributed_environment() -> None:
    """Leave the world: destroy every group this module created (idempotent)."""
    global _WORLD
    destroy_model_parallel()
    if _WORLD is not None:
        if _WORLD.cpu_group is not _WORLD.device_group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(_WORLD.cpu_group)
        _WORLD = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
