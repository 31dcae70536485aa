"""The worker's half of the elastic cache's block move: the bytes and the requests' ids."""

from types import SimpleNamespace

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.worker import kv_cache
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.kv_cache import copy_kv_blocks


def test_copy_kv_blocks_moves_every_layers_blocks_in_bounded_pieces(monkeypatch):
    # [num_blocks, 2, block_size, heads, head_size]; a 2-block temporary per launch.
    views = {f"l{i}": torch.randn(12, 2, 4, 2, 8) for i in range(3)}
    monkeypatch.setattr(kv_cache, "COPY_BLOCKS_TEMP_BYTES", 2 * 2 * 4 * 2 * 8 * 4)
    before = {k: v.clone() for k, v in views.items()}
    src, dst = [9, 11, 10, 8, 7], [1, 2, 3, 5, 6]
    copy_kv_blocks(views, src, dst)
    for name, view in views.items():
        assert torch.equal(view[dst], before[name][src])
        untouched = [i for i in range(12) if i not in dst]
        assert torch.equal(view[untouched], before[name][untouched])
    with pytest.raises(ValueError, match="pairwise disjoint"):
        copy_kv_blocks(views, [3, 4], [4, 5])
    with pytest.raises(ValueError, match="2 sources and 1 destinations"):
        copy_kv_blocks(views, [3, 4], [5])


def _state(req_id, block_ids):
    return CachedRequestState(req_id=req_id, prompt_token_ids=[1, 2, 3],
                              sampling_params=SamplingParams(), generator=None,
                              block_ids=block_ids, num_computed_tokens=3)


def test_rename_blocks_rewrites_the_states_and_the_rows_in_the_batch():
    batch = InputBatch(4, 64, 4, torch.device("cpu"), pin_memory=False)
    a, b, out = _state("a", [1, 9, 10]), _state("b", [2, 9]), _state("c", [11, 3])
    given = a.block_ids
    batch.add(a)
    batch.add(b)
    batch.rename_blocks([a, b, out], {9: 4, 10: 5, 11: 6})
    assert (a.block_ids, b.block_ids, out.block_ids) == ([1, 4, 5], [2, 4], [6, 3])
    assert given == [1, 9, 10]  # replaced, not edited: the scheduler output's list
    assert batch.block_table.np[0, :4].tolist() == [1, 4, 5, 0]
    assert batch.block_table.np[1, :3].tolist() == [2, 4, 0]


def test_the_runner_renames_blocks_only_after_the_step_in_flight_uploaded_its_table():
    """Async scheduling: step N's block table goes to the device by a non-blocking copy
    of the pinned host table; the move rewrites that table, so it waits for the copy
    (found in review: step N could otherwise read the new ids before the bytes moved)."""
    events = []
    batch = InputBatch(4, 64, 4, torch.device("cpu"), pin_memory=False)
    state = CachedRequestState(req_id="a", prompt_token_ids=[1, 2, 3],
                               sampling_params=SamplingParams(), generator=None,
                               block_ids=[1, 9], num_computed_tokens=3)
    batch.add(state)
    set_row = batch.block_table.set_row
    batch.block_table.set_row = lambda *a: (events.append("rewrite pinned block table"),
                                            set_row(*a))
    # Step N is in flight: its H2D copy of block_table.cpu (pinned, non_blocking) may not
    # have run yet; execute_model guards that buffer with async_state.wait_inputs_copied().
    async_state = SimpleNamespace(
        wait_inputs_copied=lambda: events.append("wait_inputs_copied"))
    runner = SimpleNamespace(kv_caches={"l0": torch.zeros(12, 2, 4, 1, 2)}, input_batch=batch,
                             requests={"a": state}, async_state=async_state)
    GPUModelRunner.move_kv_blocks(runner, [9], [3])
    assert batch.block_table.np[0, :2].tolist() == [1, 3]
    assert events == ["wait_inputs_copied", "rewrite pinned block table"], events
