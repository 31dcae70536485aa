"""Sleep mode on CUDA: graphs replay after wake without re-capture; memory really returns."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.model_dirs import make_model_dir, smollm2_config
from vllm import LLM, SamplingParams
from vllm.v1.worker.cuda_graph import CUDAGraphManager

pytestmark = pytest.mark.cuda

# What stays on the device after sleep(1), besides the CUDA context: CUDA graph
# pools, rope tables, the attention split workspace, library workspaces and
# loaded kernels. Measured on the H200 (docs/extensible_kv_cache.md).
SLEEP_RESIDUAL_BYTES = 1 << 30

PROMPTS = [{"prompt_token_ids": [0] + list(range(7, 7 + n))} for n in (5, 40, 300)]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sleep_wake_keeps_graphs_and_returns_memory(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", smollm2_config(), weights=False)
    gc.collect()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        enable_sleep_mode=True,
        gpu_memory_utilization=0.5,
    )
    try:
        worker = llm.llm_engine.engine_core.worker
        assert worker.model_runner.cuda_graphs.captured
        reference = _tokens(llm)
        captures = CUDAGraphManager.num_captures
        kv_base = worker.kv_cache.tensor.base
        weight_ptr = next(worker.model_runner.model.parameters()).data_ptr()

        for level in (1, 2):
            llm.sleep(level=level)
            torch.cuda.synchronize()
            free_asleep, _ = torch.cuda.mem_get_info()
            residual = free_before - free_asleep
            print(f"level {level}: {residual / 2**20:.0f} MiB still held while asleep")
            assert residual <= SLEEP_RESIDUAL_BYTES
            llm.wake_up()
            if level == 2:
                llm.reload_weights()
            assert _tokens(llm) == reference
            assert worker.kv_cache.tensor.base == kv_base
            assert next(worker.model_runner.model.parameters()).data_ptr() == weight_ptr
        assert CUDAGraphManager.num_captures == captures  # no re-capture
        _wake_without_memory_stays_asleep(llm, reference)
    finally:
        llm.llm_engine.shutdown()


def _wake_without_memory_stays_asleep(llm: LLM, reference: list[list[int]]) -> None:
    """Another allocation takes the memory while the engine sleeps: wake_up raises
    DeviceMemoryError naming the bytes it needs and the bytes free (the server's 503),
    the engine stays asleep, and a wake after the memory returns restores the outputs."""
    from vllm.exceptions import DeviceMemoryError

    worker = llm.llm_engine.engine_core.worker
    llm.sleep(level=1)
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")  # 256 MiB left
    try:
        with pytest.raises(DeviceMemoryError, match=r"needs \d+\.\d+ GiB of device memory and "
                           r"0\.\d+ GiB is free") as info:
            llm.wake_up()
        assert info.value.needed_bytes > info.value.free_bytes
        assert llm.llm_engine.is_sleeping()
    finally:
        del hog
        torch.cuda.empty_cache()
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping() and worker.sleeping_tags() == []
    assert _tokens(llm) == reference
