"""Executors and tensor parallelism on CUDA (NCCL).

One GPU: the `mp` executor at TP=1 (the worker in its own process) gives the
in-process engine's greedy ids, captures CUDA graphs in the worker and grows
the cache there. Two GPUs (skipped otherwise): TP=2 equals TP=1 (fp32), the
classic and extensible paths are byte-identical at TP=2, graphs are captured
once per rank and not again after the extension, unequal free memory gives
both ranks the smaller block count, sleep/wake keeps both ranks' addresses,
and an NCCL all-reduce replays inside a captured graph.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.model_dirs import llama_config, make_model_dir
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu_worker import Worker

pytestmark = pytest.mark.cuda

PROMPTS = [[0] + list(range(5, 5 + n)) for n in (3, 17, 40, 129)]
GiB = 1 << 30


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


needs_two_gpus = pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")


def greedy(llm: LLM, max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def shutdown(llm: LLM) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def rank_info(worker) -> dict:
    """Per rank: graph captures, KV views' data pointers, committed blocks."""
    runner = worker.model_runner
    return {
        "captures": type(runner.cuda_graphs).num_captures,  # this process's captures
        "captured": runner.cuda_graphs.captured,
        "pointers": sorted(v.data_ptr() for v in worker.kv_cache.views.values()),
        "blocks": worker.kv_cache.committed_blocks,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 8 query / 4 KV heads: an even split at TP=2.
    config = llama_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=256)
    return str(make_model_dir(tmp_path_factory.mktemp("tp"), config, weights=True))


COMMON = dict(dtype="float32", max_model_len=1024, gpu_memory_utilization=0.4)


def test_mp_executor_one_gpu(model_dir):
    inproc = LLM(model_dir, **COMMON)
    parallel = inproc.llm_engine.vllm_config.parallel_config
    assert parallel.distributed_executor_backend == "uni"
    expected = greedy(inproc)
    shutdown(inproc)
    llm = LLM(model_dir, distributed_executor_backend="mp", **COMMON)
    try:
        executor = llm.llm_engine.engine_core.model_executor
        (info,) = executor.collective_rpc(rank_info)
        assert info["captured"]
        assert greedy(llm) == expected
    finally:
        shutdown(llm)


@needs_two_gpus
def test_tp2_matches_tp1_and_paths_agree(model_dir):
    one = LLM(model_dir, **COMMON)
    expected = greedy(one)
    shutdown(one)
    outputs = {}
    for extensible in (False, True):
        llm = LLM(model_dir, tensor_parallel_size=2, enable_extensible_kv_cache=extensible,
                  **COMMON)
        try:
            executor = llm.llm_engine.engine_core.model_executor
            before = executor.collective_rpc(rank_info)
            outputs[extensible] = greedy(llm)
            after = executor.collective_rpc(rank_info)
            # Graphs captured once per rank (before any extension), never again.
            assert all(b["captured"] and b["captures"] == a["captures"] for b, a in
                       zip(before, after, strict=True))
            num_blocks = llm.llm_engine.engine_core.num_blocks
            assert before[0]["blocks"] == before[1]["blocks"] == num_blocks
        finally:
            shutdown(llm)
    assert outputs[False] == outputs[True]  # classic and extensible byte-identical at TP=2
    assert outputs[True] == expected  # TP=2 equals TP=1 (fp32)


def hold_foreign_memory(worker, rank: int, nbytes: int) -> None:
    """Rank `rank`'s GPU holds `nbytes` of memory the engine does not own (a tensor
    in the worker process that the engine's own accounting never sees)."""
    if worker.rank == rank:
        worker.foreign = torch.empty(nbytes, dtype=torch.uint8, device=worker.device)


@needs_two_gpus
def test_unequal_memory_both_ranks_take_the_minimum(model_dir):
    """Worker 1 keeps only 1.5 GiB free beside a foreign allocation made before sizing:
    both ranks end with its smaller block count. 2048 sequences: what max_num_seqs x
    max_model_len can use (2 GiB a rank) bounds rank 0, not rank 1."""
    llm = LLM(model_dir, tensor_parallel_size=2, worker_cls="tests.v1.e2e.tp_workers."
              "ForeignMemoryWorker",
              **{**COMMON, "gpu_memory_utilization": 0.9, "max_num_seqs": 2048})
    try:
        executor = llm.llm_engine.engine_core.model_executor
        proposals = executor.collective_rpc(Worker.kv_cache_agreement)[0]
        assert proposals[1] < proposals[0]
        blocks = [i["blocks"] for i in executor.collective_rpc(rank_info)]
        assert blocks == [min(proposals)] * 2
    finally:
        shutdown(llm)


@needs_two_gpus
def test_sleep_wake_tp2_keeps_addresses(model_dir):
    llm = LLM(model_dir, tensor_parallel_size=2, enable_sleep_mode=True, **COMMON)
    try:
        executor = llm.llm_engine.engine_core.model_executor
        expected = greedy(llm)
        before = executor.collective_rpc(rank_info)
        free_before = executor.collective_rpc(_free_bytes)
        llm.sleep(level=1)
        free_asleep = executor.collective_rpc(_free_bytes)
        assert all(a > b + GiB // 4 for a, b in zip(free_asleep, free_before, strict=True))
        llm.wake_up()
        after = executor.collective_rpc(rank_info)
        assert [b["pointers"] for b in before] == [a["pointers"] for a in after]
        assert greedy(llm) == expected
    finally:
        shutdown(llm)


def _free_bytes(worker) -> int:
    return torch.cuda.mem_get_info(worker.device)[0]


@needs_two_gpus
def test_nccl_all_reduce_inside_a_cuda_graph():
    from tests.v1.executor.conftest import make_config
    from tests.v1.executor.workers import NcclGraphWorker
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(make_config(2, "mp", worker="NcclGraphWorker"))
    try:
        executor.collective_rpc(NcclGraphWorker.init_device)
        assert executor.collective_rpc(NcclGraphWorker.all_reduce_in_graph) == [[3.0, 3.0, 3.0]] * 2
    finally:
        executor.shutdown()


@needs_two_gpus
def test_ray_executor_tp2(model_dir):
    pytest.importorskip("ray")
    one = LLM(model_dir, **COMMON)
    expected = greedy(one)
    shutdown(one)
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **COMMON)
    try:
        assert llm.llm_engine.engine_core.model_executor.uses_ray
        assert greedy(llm) == expected
    finally:
        shutdown(llm)
