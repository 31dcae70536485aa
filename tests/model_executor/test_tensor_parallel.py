"""Tensor parallelism over 2 CPU processes (gloo): sharded weights, all-reduce and
all-gather give the same logits as one process."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.model_executor.generation import run_schedule, schedule_sequences
from tests.model_executor.hf_checkpoints import make_hf_model, save_checkpoint
from vllm.model_executor.model_loader import get_model
from vllm.transformers_utils.config import get_hf_config

# llama3_rope_tied: 1 kv head (replicated on both ranks), tied head, odd vocab
# (101: the last vocab shard is padded). qwen2: 2 kv heads (split), q/k/v bias.
NAMES = ("llama3_rope_tied", "qwen2")


def _run(directory: str, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    config = get_hf_config(directory)
    model = get_model(directory, config, torch.float32, "cpu", tp_rank=tp_rank, tp_size=tp_size)
    return run_schedule(model, schedule_sequences(config.vocab_size, seed=11), block_size=4)


def _worker(rank: int, world_size: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        for name in NAMES:
            torch.save(_run(f"{root}/{name}", rank, world_size), f"{root}/{name}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_matches_tp1(tmp_path):
    for name in NAMES:
        save_checkpoint(make_hf_model(name), tmp_path / name)
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for name in NAMES:
        reference = _run(str(tmp_path / name), 0, 1)
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            for key, logits in reference.items():
                torch.testing.assert_close(got[key], logits, atol=5e-5, rtol=5e-5)
