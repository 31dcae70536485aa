"""What a worker does because it is one of several ranks (nothing, with one rank).

    init_device               join_process_group: the world and TP groups (NCCL / gloo)
    load_model                tensor_parallel_rank: which shard of the model this rank holds
    allocate                  each_rank: every rank's value (its block's bytes, so the
                              explicit size is checked against the largest on every rank)
    classic / measured size   on_every_rank: a sizing error on any rank fails every rank
                              agree_on_num_blocks: the minimum over every rank's count,
                              logged with the rank that bounded it
    after warmup              resync_random_state: one RNG state on every rank
    shutdown                  leave_process_group

Why every rank must agree on the block count: the scheduler hands out one
block id per block for all ranks, and each rank keeps its own heads of that
block, so a count one rank cannot hold is a count no rank may use. Why the
sizing errors are exchanged first: a rank that raised never joins the
agreement's all-gather, and the others would wait in it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

from vllm.logger import init_logger
from vllm.platforms.interface import Platform
from vllm.v1.worker import kv_cache_sizing as sizing

logger = init_logger(__name__)
T = TypeVar("T")


def join_process_group(
    world_size: int,
    rank: int,
    init_method: str | None,
    local_rank: int,
    tensor_parallel_size: int,
    platform: Platform,
) -> None:
    """Join the engine's world and create the tensor-parallel group (blocks for all ranks)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if init_method is None:
        raise RuntimeError(
            f"rank {rank} of {world_size} has no rendezvous address "
            "(distributed_init_method); run it through the 'mp' or 'ray' executor"
        )
    init_distributed_environment(world_size, rank, init_method, local_rank)
    initialize_model_parallel(tensor_parallel_size)


def register_engine_process(platform: Platform) -> None:
    """A worker in a process of its own: its parent (the engine process that started
    it) is this engine, not a foreign process sharing the device.

    Only the parent: a grandparent may be a trainer that launched the engine
    and holds memory on the same device, which is exactly what the check is for.
    """
    ppid = os.getppid()
    if ppid > 1:
        platform.register_engine_pid(ppid)


def tensor_parallel_rank(world_size: int) -> tuple[int, int]:
    """(this rank's tensor-parallel rank, the tensor-parallel size)."""
    if world_size == 1:
        return 0, 1
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.rank_in_group, group.world_size


def each_rank(world_size: int, value: T) -> list[T]:
    """Every rank's `value`, in rank order (an all-gather; `[value]` with one rank).

    For a check whose outcome must be the same on every rank: each rank applies it
    to all the values alike, so all raise the same error or none does.
    """
    if world_size == 1:
        return [value]
    from vllm.distributed import get_world_group

    return list(get_world_group().all_gather_object(value))


def on_every_rank(world_size: int, compute: Callable[[], T]) -> T:
    """`compute()` on this rank; if it raised on any rank, raise on every rank.

    Raises:
        KVCacheSizingError: naming each rank that failed and its reason (a
            sizing error of this rank is re-raised as it is with one rank).
    """
    if world_size == 1:
        return compute()
    from vllm.distributed import get_world_group

    try:
        result, failure = compute(), None
    except sizing.KVCacheSizingError as e:
        result, failure = None, str(e)
    failures = get_world_group().all_gather_object(failure)
    problems = [f"rank {rank}: {reason}" for rank, reason in enumerate(failures) if reason]
    if problems:
        raise sizing.KVCacheSizingError("; ".join(problems))
    return result


def agree_on_num_blocks(world_size: int, rank: int, num_blocks: int) -> tuple[int, list[int]]:
    """(the block count every rank uses: the minimum of all ranks' `num_blocks`,
    every rank's count in rank order); rank 0 logs it with the rank that bounded it."""
    if world_size == 1:
        counts = [num_blocks]
    else:
        from vllm.distributed import get_world_group

        counts = [int(n) for n in get_world_group().all_gather_object(num_blocks)]
    agreed = sizing.min_across_ranks(counts)
    if len(counts) > 1 and rank == 0:
        logger.info(
            "KV cache blocks agreed across %d ranks: %d (rank %d bounds it; ranks: %s)",
            len(counts),
            agreed,
            counts.index(agreed),
            ", ".join(str(n) for n in counts),
        )
    return agreed, counts


def resync_random_state(world_size: int, seed: int | None) -> None:
    """Seed every rank's generator alike once start-up is done.

    Every rank samples the same (all-gathered) logits and must pick the same
    tokens; start-up consumed random numbers unevenly (random weights of
    differently sized shards), so the generators are re-seeded here from the
    engine's seed (the config always has one with several ranks).
    """
    if world_size > 1 and seed is not None:
        torch.manual_seed(seed)


def leave_process_group(world_size: int) -> None:
    if world_size > 1:
        from vllm.distributed import destroy_distributed_environment

        destroy_distributed_environment()
