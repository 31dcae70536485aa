"""Requests whose KV a connector loads in the background (WAITING_FOR_REMOTE_KVS).

The real scheduler and block pool, the fake runner (which checks every KV
position a request attends to), and a connector whose loads finish when the
test says: a load in flight must never hold other requests back, a finished
load must leave the request computing only what was not loaded (and equal to
computing everything), a failed load fails that request alone, and an abort
during a load keeps the blocks until the load is over.
"""

from __future__ import annotations

import dataclasses

from tests.v1.core.fake_runner import FakeRunner, check_invariants, make_request, make_scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

BS = 4


class BackgroundLoads:
    """The scheduler side of a connector that loads the prompts of `remote` ids in the
    background; `finish(runner, id)` writes their KV as a finished READ would."""

    def __init__(self, remote: set[str]) -> None:
        self.remote = remote
        self.planned: dict[str, tuple[list[int], int, int, list[int]]] = {}
        self.started: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id not in self.remote or request.request_id in self.planned:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:  # leading hashed blocks are prefix-cache hits (as NIXL's)
            hit = next((i for i, b in enumerate(blocks) if b.block_hash is None), len(blocks))
            self.planned[request.request_id] = (
                [b.block_id for b in blocks], hit * BS, hit * BS + num_external_tokens,
                list(request.all_token_ids))

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def update_connector_output(self, connector_output):
        return None

    def sleep(self):
        return None

    def finish(self, runner: FakeRunner, req_id: str) -> None:
        block_ids, start, end, tokens = self.planned[req_id]
        for pos in range(start, end):
            runner.kv[(block_ids[pos // BS], pos % BS)] = hash(tuple(tokens[: pos + 1]))


def _step(sched, runner, recving=(), failed=None):
    so = sched.schedule()
    out = runner.execute_model(so)
    kv = KVConnectorOutput(finished_recving=set(recving), failed_recving=dict(failed or {}))
    outs = sched.update_from_output(so, dataclasses.replace(out, kv_connector_output=kv))
    check_invariants(sched)
    return so, {o.request_id: o for o in outs}


def _setup(remote: set[str]):
    loads = BackgroundLoads(remote)
    return make_scheduler(block_size=BS, connector=loads), FakeRunner(BS), loads


def test_a_load_in_flight_holds_nobody_back_and_ends_as_if_computed():
    sched, runner, loads = _setup({"remote"})
    sched.add_request(make_request("local", 6, max_tokens=12, ignore_eos=True))
    sched.add_request(make_request("remote", 30, max_tokens=4, ignore_eos=True))
    tokens: dict[str, list[int]] = {"local": [], "remote": []}
    for _ in range(5):  # the load runs: "local" steps on, "remote" is never scheduled
        so, outs = _step(sched, runner)
        assert "remote" not in so.num_scheduled_tokens
        assert len(outs["local"].new_token_ids) == 1
        tokens["local"] += outs["local"].new_token_ids
    remote = sched.requests["remote"]
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.get_stats().num_waiting_for_remote_kvs == 1
    assert len(sched.kv_cache_manager.get_blocks("remote")) == -(-31 // BS)  # prompt + 1 slot
    loads.finish(runner, "remote")
    _, outs = _step(sched, runner, recving={"remote"})  # the report: promoted next step
    tokens["local"] += outs["local"].new_token_ids
    assert remote.status == RequestStatus.WAITING and remote.num_computed_tokens == 29
    so, outs = _step(sched, runner)
    assert so.num_scheduled_tokens["remote"] == 1  # only the last prompt token computed
    for req_id, out in outs.items():
        tokens[req_id] += out.new_token_ids
    while sched.has_requests():
        _, outs = _step(sched, runner)
        for req_id, out in outs.items():
            tokens[req_id] += out.new_token_ids
    # The same tokens as computing both prompts here.
    ref_sched, ref_runner, _ = _setup(set())
    ref = {}
    for req_id, n, m in (("local", 6, 12), ("remote", 30, 4)):
        ref_sched.add_request(make_request(req_id, n, max_tokens=m, ignore_eos=True))
    while ref_sched.has_requests():
        _, outs = _step(ref_sched, ref_runner)
        for req_id, out in outs.items():
            ref.setdefault(req_id, []).extend(out.new_token_ids)
    assert tokens == ref
    # "remote" shares its first block with "local": a prefix-cache hit, not loaded again.
    assert sched.prompt_tokens_by_source["external_kv_transfer"] == 25


def test_a_failed_load_fails_that_request_alone_and_frees_its_blocks():
    sched, runner, loads = _setup({"remote"})
    sched.add_request(make_request("local", 6, max_tokens=6, ignore_eos=True))
    sched.add_request(make_request("remote", 30, max_tokens=4))
    _step(sched, runner)
    free_before = sched.kv_cache_manager.get_num_free_blocks()
    _, outs = _step(sched, runner, failed={"remote": "the producer died"})
    assert outs["remote"].finish_reason.name == "ABORT"
    assert "the producer died" in outs["remote"].error
    assert "remote" not in sched.requests and "remote" not in sched.connector.loading
    assert sched.kv_cache_manager.get_num_free_blocks() >= free_before + 7
    assert len(outs["local"].new_token_ids) == 1  # the same step still served "local"


def test_an_abort_during_a_load_keeps_the_blocks_until_the_load_is_over():
    sched, runner, loads = _setup({"remote"})
    sched.add_request(make_request("remote", 30, max_tokens=4))
    _step(sched, runner)
    sched.finish_requests("remote", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.has_pending_kv_transfers()  # the READ may still write into its blocks
    assert sched.get_stats().num_kv_transfer_held_blocks == 8
    blocks = sched.kv_cache_manager.get_block_ids("remote")
    assert all(sched.kv_cache_manager.block_pool.blocks[b].ref_cnt == 1 for b in blocks)
    _step(sched, runner, recving={"remote"})
    assert not sched.has_pending_kv_transfers()
    assert sched.kv_cache_manager.get_block_ids("remote") == []
    assert sched.get_stats().num_kv_transfer_held_blocks == 0
