"""Torch-free helpers of the parallel setup: how sizes and heads split over ranks, and
the ranks' rendezvous address (a free port on rank 0's node; its IP comes from the executor)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from vllm import envs


def get_open_port() -> int:
    """A TCP port that is free on this host now (bound to port 0, then released).

    `VLLM_PORT`, when set, is used instead (vLLM's variable), so a firewall
    can be opened for a known port.

    Raises:
        ValueError: VLLM_PORT is not a port number.
    """
    if envs.VLLM_PORT is not None:
        return envs.VLLM_PORT
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def get_distributed_init_method(ip: str, port: int) -> str:
    """The torch.distributed rendezvous URL for `ip:port` ("tcp://[v6]:port" for IPv6)."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{port}"


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, which must be whole.

    Raises:
        ValueError: naming `what` when `denominator` does not divide `numerator`.
    """
    if denominator <= 0 or numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Raise ValueError unless 0 <= tp_rank < tp_size."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank ({tp_rank}) must be in [0, tp_size={tp_size})")


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads),
    key/value heads [kv_start, kv_start + num_kv_heads) of the checkpoint's heads."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def partition_attention_heads(
    total_num_heads: int, total_num_kv_heads: int, tp_size: int, tp_rank: int
) -> HeadShard:
    """Which heads rank `tp_rank` of `tp_size` holds.

    Query heads stay with their key/value head (grouped-query attention), so
    the split is by KV head:

    - tp_size <= KV heads: the KV heads are dealt out in contiguous runs whose
      lengths differ by at most one (the first ranks take the extra head), and
      each rank takes the query heads of its KV heads. Even when the TP size
      divides the count (vLLM's rule), uneven otherwise.
    - tp_size > KV heads: each KV head is replicated on tp_size / KV-heads
      ranks (which must be whole), and the query heads split evenly (their
      count must be divisible by tp_size).

    Raises:
        ValueError: the head counts cannot be split over tp_size ranks (naming them).
    """
    check_tp(tp_rank, tp_size)
    if total_num_kv_heads < 1 or total_num_heads % total_num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({total_num_heads}) must be a multiple of "
            f"num_key_value_heads ({total_num_kv_heads})"
        )
    group = total_num_heads // total_num_kv_heads
    if tp_size <= total_num_kv_heads:
        base, extra = divmod(total_num_kv_heads, tp_size)
        num_kv = base + (tp_rank < extra)
        kv_start = tp_rank * base + min(tp_rank, extra)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if tp_size % total_num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) is larger than num_key_value_heads "
            f"({total_num_kv_heads}) but not a multiple of it: each KV head must be "
            "replicated on a whole number of ranks"
        )
    num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
    q_start = tp_rank * num_heads
    return HeadShard(q_start, num_heads, q_start // group, 1)
