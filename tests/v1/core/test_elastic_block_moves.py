"""Random elastic releases by moving blocks (and preempting) against the fake runner.

The fake runner keeps every KV position a request attends to and checks it each step;
releases (preempt to a budget, `move_blocks_below`, shrink) and growths happen between
steps at random, with prefix caching on, synchronous and with a step in flight. Outputs
must equal a run with a roomy pool, and the pool's invariants hold after every step.
"""
import random

import pytest

from tests.v1.core.fake_runner import (
    FakeRunner,
    RunResult,
    check_invariants,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)
from tests.v1.core.test_scheduler_async import run_async


class MovingRunner(FakeRunner):
    """What `Worker.move_kv_blocks` does, on the fake runner's KV and block ids."""

    def move(self, src, dst):
        moves = dict(zip(src, dst, strict=True))
        for s, d in moves.items():
            for o in range(self.block_size):
                v = self.kv.get((s, o))
                self.kv.pop((d, o), None)
                if v is not None:
                    self.kv[(d, o)] = v
        for state in self.states.values():
            state.block_ids = [moves.get(b, b) for b in state.block_ids]


def workload(seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 1000) for _ in range(9)] for _ in range(3)]
    out = []
    for i in range(30):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 10)]
        prompt = prompt + [rng.randrange(10, 1000) for _ in range(rng.randrange(0, 8))]
        out.append((f"r{i}", prompt, rng.randrange(1, 14)))
    return out


def release(rng, sched, runner, lo, hi):
    kv = sched.kv_cache_manager
    if rng.random() < 0.3 and kv.num_blocks < hi:
        sched.resize_kv_cache(min(hi, kv.num_blocks + rng.randrange(1, 12)))
        return
    if rng.random() < 0.5 or kv.num_blocks <= lo:
        return
    b = rng.randrange(lo, kv.num_blocks)
    in_use_after = sched.blocks_in_use_after_preempting(max(0, b - 1 - 2))
    sched.preempt_for_shrink(max(0, b - 1 - 2))
    assert kv.num_blocks_in_use() == in_use_after  # the dry run counts as the preemption frees
    src, dst = kv.move_blocks_below(b, [r.request_id for r in sched.running])
    if src:
        runner.move(src, dst)
    t = max(b, kv.num_blocks - kv.num_free_tail_blocks())
    if t < kv.num_blocks:
        sched.resize_kv_cache(t)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("use_async", [False, True])
def test_random_moves_and_preemptions_for_a_peer_keep_outputs(seed, use_async):
    wl = workload(seed)

    def make(**kw):
        s = make_scheduler(max_model_len=40, async_scheduling=use_async, **kw)
        for req_id, prompt, mt in wl:
            s.add_request(make_request(req_id, prompt, max_tokens=mt))
        return s

    roomy = run_until_done(make(num_blocks=512, max_num_batched_tokens=512, max_num_seqs=64),
                           FakeRunner(block_size=4))
    rng = random.Random(seed)
    sched, runner = make(num_blocks=40, max_num_batched_tokens=32), MovingRunner(block_size=4)
    if use_async:
        res = run_async(sched, runner, on_step=lambda s, r: release(rng, s, runner, 14, 60))
    else:
        res = RunResult()
        for _ in range(3000):
            if not sched.has_requests():
                break
            release(rng, sched, runner, 14, 60)
            check_invariants(sched)
            step(sched, runner, res)
    assert res.outputs == roomy.outputs
