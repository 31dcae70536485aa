"""The scheduler with speculative decoding: 1 + k tokens, rollback of rejected drafts, counts."""

from tests.v1.core.fake_runner import make_request, make_scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus


def _step(sched, sampled: dict, spec: dict | None = None):
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[sampled.get(r, []) for r in ids],
        spec_token_ids=[(spec or {}).get(r, []) for r in ids],
    )
    return so, sched.update_from_output(so, mro)


def test_verify_step_schedules_drafts_and_rolls_back_rejected_slots():
    sched = make_scheduler(num_speculative_tokens=3)
    req = make_request("a", 8, max_tokens=10)
    sched.add_request(req)
    so, _ = _step(sched, {"a": [50]}, {"a": [51, 52, 53]})
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_spec_decode_tokens == {}
    assert req.spec_token_ids == [51, 52, 53]

    so, out = _step(sched, {"a": [51, 60]}, {"a": [61, 62, 63]})
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert out[0].new_token_ids == [51, 60]
    # 12 slots were computed; 2 rejected drafts are rolled back: tokens - 1.
    assert req.num_tokens == 11 and req.num_computed_tokens == 10
    assert len(sched.kv_cache_manager.get_blocks("a")) == 3  # slots 0..11 stay allocated

    so, out = _step(sched, {"a": [61, 62, 63, 64]}, {"a": [70, 71, 72]})
    assert so.num_scheduled_tokens == {"a": 4}
    assert req.num_tokens == 15 and req.num_computed_tokens == 14
    stats = sched.get_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    # Only real tokens are hashed for the prefix cache: the last schedule saw 11
    # tokens (2 full blocks) although its 14 slots (with drafts) filled 3 blocks.
    assert len(req.block_hashes) == 2
    assert sched.kv_cache_manager.num_cached_block["a"] == 2

    # 7 outputs of max_tokens=10: drafts are cut to 10 - 7 - 1 = 2.
    so, out = _step(sched, {"a": [70, 71, 80]})
    assert so.scheduled_spec_decode_tokens == {"a": [70, 71]}
    assert out[0].finish_reason is not None and req.num_output_tokens == 10


def test_drafts_stop_at_eos_and_budget():
    sched = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=8)
    a, b = make_request("a", 4, max_tokens=20), make_request("b", 3, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, {"a": [11], "b": [12]}, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]})
    so, out = _step(sched, {"a": [1, 2, 3, 4, 9], "b": [5, 2]})
    # a takes 1 + 4 of the 8-token budget; b gets the 3 left: its drafts are cut to 2.
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4], "b": [5, 6]}
    # a accepted "1 2" then EOS (2) stops it: the tokens after it are dropped.
    by_id = {o.request_id: o for o in out}
    assert by_id["a"].new_token_ids == [1, 2] and a.status == RequestStatus.FINISHED_STOPPED
    assert by_id["b"].new_token_ids == [5, 2] and b.is_finished()
    stats = sched.get_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 5)


def test_preemption_drops_drafts():
    sched = make_scheduler(num_speculative_tokens=2, num_blocks=6, block_size=4)
    a = make_request("a", 8, max_tokens=12)
    b = make_request("b", list(range(200, 208)), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, {"a": [11], "b": [12]}, {"a": [13, 14], "b": [15, 16]})
    # 5 usable blocks: a needs 3 for 11 slots, b then cannot get its third and is preempted.
    so, _ = _step(sched, {"a": [13, 20]}, {"a": [21, 22]})
    assert so.preempted_req_ids == {"b"} and b.spec_token_ids == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0


def test_lookahead_slots_for_a_draft_model_are_held_but_never_cached():
    sched = make_scheduler(num_speculative_tokens=3, num_lookahead_tokens=3)
    req = make_request("a", 8, max_tokens=10)
    sched.add_request(req)
    _step(sched, {"a": [50]}, {"a": [51, 52, 53]})
    # 8 prompt tokens + 3 lookahead slots: 3 blocks of 4; only the 2 full prompt blocks cached.
    assert len(sched.kv_cache_manager.get_blocks("a")) == 3
    assert sched.kv_cache_manager.num_cached_block["a"] == 2
    so, _ = _step(sched, {"a": [51, 60]})
    # Verify step: 9 tokens computed so far + 4 scheduled + 3 lookahead = 15 slots -> 4 blocks.
    assert so.num_scheduled_tokens == {"a": 4}
    assert len(sched.kv_cache_manager.get_blocks("a")) == 4
