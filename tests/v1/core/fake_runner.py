"""Test helpers for the torch-free core: request factory, a fake model runner, a driver loop.

`FakeRunner` plays the model runner against the real scheduler contract: it
keeps per-request state from SchedulerOutput the way the real runner must,
writes a simulated KV cache (one entry per slot, identifying the whole
token prefix the KV at that position depends on), and before "sampling"
checks that every position a request attends to holds exactly the right
entry. A wrong block table, a bad prefix-cache hit or a block overwritten
while still in use therefore fails the test at the step it happens.

Sampled tokens are a deterministic function of the token sequence (or come
from a per-request script), so a run with preemption must produce the same
outputs as a run without.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import PriorityRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import EngineCoreOutput, FinishReason, LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request

EOS = 2
VOCAB_SIZE = 1000
_FIRST_ORDINARY_TOKEN = 10  # generated tokens avoid 0..9 (EOS and test stop ids) unless scripted


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    eos_token_id: int | None = EOS,
    cache_salt: str | None = None,
    arrival_time: float | None = None,
    priority: int = 0,
    **sampling_kwargs,
) -> Request:
    """A Request over the real SamplingParams; `prompt` may be a length (tokens 100, 101, ...)."""
    if isinstance(prompt, int):
        prompt = list(range(100, 100 + prompt))
    sampling_kwargs.setdefault("max_tokens", 16)
    return Request(
        req_id,
        prompt,
        SamplingParams(**sampling_kwargs),
        eos_token_id,
        arrival_time=arrival_time,
        cache_salt=cache_salt,
        priority=priority,
    )


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        block_size=4,
        num_blocks=64,
        enable_prefix_caching=True,
    )
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    return _FIRST_ORDINARY_TOKEN + hash(tuple(tokens)) % (VOCAB_SIZE - _FIRST_ORDINARY_TOKEN)


@dataclass
class _RunnerRequestState:
    tokens: list[int]  # prompt + tokens sampled so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_logprob_rows: int = 0  # prompt positions already reported


class FakeRunner:
    """Consumes SchedulerOutput, returns ModelRunnerOutput; asserts the contract.

    Args:
        block_size: tokens per block (must match the scheduler's).
        script: req_id -> output tokens to emit in order (the k-th output is
            script[k]; past the script's end the fake model takes over).
        with_logprobs: also return one LogprobsLists row per request whose
            entry 0 is the sampled token, logprob -0.5, rank 1.

    Requests whose SamplingParams ask for prompt_logprobs get one row per
    prompt position computed in the step (entry 0 = the next prompt token).
    """

    def __init__(
        self,
        block_size: int,
        script: dict[str, list[int]] | None = None,
        with_logprobs: bool = False,
    ) -> None:
        self.block_size = block_size
        self.script = script or {}
        self.with_logprobs = with_logprobs
        self.states: dict[str, _RunnerRequestState] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block_id, offset) -> hash of the token prefix
        self.sampling_params: dict[str, SamplingParams] = {}
        self.num_steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self._update_states(so)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        req_ids = list(so.num_scheduled_tokens)
        # Like a layer of the real model: the whole batch writes its K/V before anyone reads.
        for req_id in req_ids:
            self._write_kv(self.states[req_id], so.num_scheduled_tokens[req_id])
        sampled = []
        prompt_logprobs = {}
        for req_id in req_ids:
            state = self.states[req_id]
            end = state.num_computed_tokens + so.num_scheduled_tokens[req_id]
            self._check_kv(req_id, state, end)
            if self.sampling_params[req_id].prompt_logprobs is not None:
                rows = self._prompt_logprobs(state, end)
                if rows is not None:
                    prompt_logprobs[req_id] = rows
            state.num_computed_tokens = end
            if end == len(state.tokens):
                token = self._sample(req_id, state)
                state.tokens.append(token)
                sampled.append([token])
            else:
                assert end < len(state.tokens), f"{req_id}: computed past its tokens"
                sampled.append([])
        logprobs = None
        if self.with_logprobs:
            rows = [[s[0] if s else 0] for s in sampled]
            logprobs = LogprobsLists(rows, [[-0.5]] * len(rows), [1] * len(rows))
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
        )

    # ---- contract checks ----

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
            self.sampling_params.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = _RunnerRequestState(
                list(new.prompt_token_ids),
                len(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            )
            self.sampling_params[new.req_id] = new.sampling_params
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
                state.num_computed_tokens = cached.num_computed_tokens[i]
            else:
                assert cached.num_computed_tokens[i] == state.num_computed_tokens, req_id
                state.block_ids.extend(cached.new_block_ids[i])
        for req_id in so.num_scheduled_tokens:
            assert req_id in self.states, f"{req_id} scheduled but never sent"

    def _write_kv(self, state: _RunnerRequestState, num_tokens: int) -> None:
        start = state.num_computed_tokens
        assert start + num_tokens <= len(state.tokens)
        for pos in range(start, start + num_tokens):
            self.kv[self._slot(state, pos)] = hash(tuple(state.tokens[: pos + 1]))

    def _check_kv(self, req_id: str, state: _RunnerRequestState, end: int) -> None:
        for pos in range(end):
            expected = hash(tuple(state.tokens[: pos + 1]))
            assert self.kv.get(self._slot(state, pos)) == expected, (
                f"{req_id}: wrong KV at position {pos} (blocks {state.block_ids})"
            )

    def _slot(self, state: _RunnerRequestState, pos: int) -> tuple[int, int]:
        block_id = state.block_ids[pos // self.block_size]
        assert block_id != 0, "the null block must never be addressed"
        return block_id, pos % self.block_size

    # ---- outputs ----

    def _sample(self, req_id: str, state: _RunnerRequestState) -> int:
        k = len(state.tokens) - state.num_prompt_tokens
        script = self.script.get(req_id, [])
        return script[k] if k < len(script) else next_token(state.tokens)

    def _prompt_logprobs(self, state: _RunnerRequestState, end: int) -> LogprobsLists | None:
        # One row per prompt position not reported yet whose next token is in the prompt.
        positions = range(state.num_prompt_logprob_rows, min(end, state.num_prompt_tokens - 1))
        if not positions:
            return None
        state.num_prompt_logprob_rows = positions.stop
        rows = [[state.tokens[p + 1]] for p in positions]
        return LogprobsLists(rows, [[-1.0]] * len(rows), [1] * len(rows))


@dataclass
class RunResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    engine_outputs: list[list[EngineCoreOutput]] = field(default_factory=list)
    scheduler_outputs: list[SchedulerOutput] = field(default_factory=list)


def step(scheduler: Scheduler, runner: FakeRunner, result: RunResult | None = None) -> RunResult:
    """One schedule -> execute -> update, checking the step's budgets."""
    result = result if result is not None else RunResult()
    so = scheduler.schedule()
    assert so.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= scheduler.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    outs = scheduler.update_from_output(so, runner.execute_model(so))
    check_invariants(scheduler)
    result.scheduler_outputs.append(so)
    result.engine_outputs.append(outs)
    for out in outs:
        result.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            result.finish_reasons[out.request_id] = out.finish_reason
            result.stop_reasons[out.request_id] = out.stop_reason
    return result


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner,
    result: RunResult | None = None,
    max_steps: int = 2000,
) -> RunResult:
    """Step until no request is left (finished ids included); accumulates into `result`."""
    result = result if result is not None else RunResult()
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return result
        step(scheduler, runner, result)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def check_invariants(scheduler: Scheduler) -> None:
    """Block and queue invariants that must hold between steps."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free), block
    assert 0 not in free and pool.null_block.ref_cnt == 0
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    holders_ids = {r.request_id for r in scheduler.running}
    if scheduler.connector is not None:  # loads in flight and blocks held for readers
        c = scheduler.connector
        holders_ids |= set(c.loading) | set(c.aborted_loads) | set(c.sending)
        holders_ids |= {r.request_id for r in scheduler.waiting if r.num_computed_tokens}
    assert set(kv.req_to_blocks) == holders_ids
    if isinstance(scheduler.waiting, PriorityRequestQueue):  # the worst is preempted first
        order = [(r.priority, r.arrival_time) for r in scheduler.running]
        assert order == sorted(order), "running must stay in (priority, arrival) order"
    elif not scheduler.prefill_policy.concurrent:  # else short prompts may jump ahead
        order = [r.arrival_time for r in scheduler.running]
        assert order == sorted(order), "running must stay in arrival order"
