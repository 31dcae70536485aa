"""Scheduler: continuous batching under one token budget per step (torch-free).

One step::

    schedule() -> SchedulerOutput -> model runner -> ModelRunnerOutput -> update_from_output()

`schedule()` picks each request's tokens and KV blocks for the step;
`update_from_output()` appends sampled tokens, applies stop checks, frees
finished requests' blocks. Helpers: step.py (the plan), spec_decode.py (drafts);
components: `connector` (kv_connector.py), `prefill_policy` (partial_prefills.py),
`structured_outputs` (structured_outputs.py: requests wait for their grammar's compile),
`preemption` (preemption.py: who gives way when blocks run out or a peer takes the tail).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.elastic import ElasticKVPolicy
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.kv_connector import SchedulerKVConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.partial_prefills import PartialPrefills
from vllm.v1.core.sched.preemption import MayPreempt, Preemption
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.spec_decode import SpecDecodeScheduling
from vllm.v1.core.sched.stats import SchedulerStats
from vllm.v1.core.sched.step import StepPlan, make_engine_core_output, package_plan
from vllm.v1.core.sched.structured_outputs import GrammarSource, SchedulerStructuredOutputs
from vllm.v1.core.sched.utils import check_fits_cache, check_positive, check_prompt, check_stop
from vllm.v1.outputs import EngineCoreOutput, FinishReason, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.sched.kv_connector import KVConnectorScheduler

logger = init_logger(__name__)

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler:
    """Continuous batching (fcfs or priority order), chunked prefill, preemption by recompute.

    Args (plain ints, no config objects):
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest sequence (prompt + output) in tokens.
        block_size: tokens per KV block.
        num_blocks: KV blocks including the null block 0.
        enable_prefix_caching: reuse full blocks across requests by content hash.
        enable_chunked_prefill: split prompts across steps to fit the budget.
            Without it a prompt is scheduled whole or not at all, which needs
            max_num_batched_tokens >= max_model_len.
        long_prefill_token_threshold, max_num_partial_prefills,
            max_long_partial_prefills: vLLM's concurrent partial prefills, see
            `partial_prefills.py` (defaults: vLLM V1's one partial prefill).
        connector: the scheduler side of a KV connector (`KVConnectorScheduler`:
            a `KVConnectorBase_V1` in the scheduler role), or None. It may
            supply tokens beyond the prefix-cache hit, loaded into the
            request's new blocks in the same step, or in the background while
            the request waits in WAITING_FOR_REMOTE_KVS (other requests keep
            stepping); it sees every step's plan, and may keep a finished
            request's blocks until its worker side has sent them.
        num_speculative_tokens: k of speculative decoding (0 = off): a decoding
            request with drafts (`Request.spec_token_ids`, proposed by the
            runner) is scheduled for 1 + up to k tokens; the rejected drafts'
            KV slots are reused by rolling num_computed_tokens back.
        num_lookahead_tokens: KV slots every scheduled request holds beyond
            its tokens of the step (a draft model writes its k proposals' KV).
        async_scheduling: `schedule()` is called again before the previous
            step's output reached `update_from_output()`. A request that will
            sample in a scheduled step counts an output placeholder
            (`Request.num_output_placeholders`) until its token arrives, so it
            can be scheduled for the next step; a request whose placeholders
            already reach max_tokens or max_model_len is not scheduled again.
            A request that stops (EOS, stop token, stop string, abort) at step
            N may already be in step N+1: that step's output for it is dropped.
            With speculative decoding a decoding request taking drafts counts 1 + k'
            placeholders a step (`SpecDecodeScheduling`, spec_decode.py).
        elastic: the elastic KV cache's policy (`ElasticKVPolicy`), or None
            for a fixed cache. With one, the engine core asks the policy what
            block count it wants, `resize_kv_cache()` adopts what the workers
            committed, and requests are admitted against what the cache may
            grow to (`max_num_blocks`), not what it holds now.
        grammar_compiler: compiles structured-output constraints off the step (a request
            waits in WAITING_FOR_FSM meanwhile); None: such requests are refused.
        encoder: images' encoder budget and cache (`EncoderCacheManager`), or None.
        scheduling_policy: "fcfs" or "priority": the order of `waiting` and `running`
            (`RequestQueue`, request_queue.py: admission and preemption order).

    Raises:
        ValueError: a value is out of range or the combination can never work.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int = 1,
        connector: KVConnectorScheduler | None = None,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        async_scheduling: bool = False,
        elastic: ElasticKVPolicy | None = None,
        grammar_compiler: GrammarSource | None = None,
        encoder: EncoderCacheManager | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        check_positive(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}) with chunked prefill disabled, so longer "
                "prompts could never be scheduled; raise max_num_batched_tokens, lower "
                "max_model_len or enable chunked prefill"
            )
        self.prefill_policy = PartialPrefills(
            max_num_partial_prefills, max_long_partial_prefills, long_prefill_token_threshold,
            max_model_len, enable_chunked_prefill,
        )
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        self.async_scheduling = async_scheduling
        self.kv_cache_manager = kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, max_model_len)
        self.elastic, self.encoder = elastic, encoder or EncoderCacheManager(0, 0)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(scheduling_policy)  # preempted ones go back first
        # Placed by `waiting.place_running`: fcfs admission order (concurrent partial prefills
        # may admit a short prompt before an earlier long one), or (priority, arrival) order.
        # running[-1] is preempted first (`preemption`).
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # finished since the last schedule()
        self.num_prefill_tokens = 0  # cumulative, by chunk
        self.preemption = Preemption(kv, self.encoder, self.waiting, num_lookahead_tokens)
        self.connector = None if connector is None else SchedulerKVConnector(connector, kv)
        self.prompt_tokens_by_source = {
            "local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec = SpecDecodeScheduling(num_speculative_tokens, async_scheduling, max_model_len)
        self.spec_decoding_stats = self.spec.stats  # drafts and their counts: spec_decode.py
        self.structured_outputs = SchedulerStructuredOutputs(grammar_compiler)

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        """Queue a new request (`waiting.add`: its place under the scheduling policy).

        Raises:
            ValueError: duplicate id. VLLMValidationError (a ValueError whose
                `parameter` is "prompt" or "max_tokens"): empty prompt, prompt
                longer than max_model_len, or a sequence that needs more blocks
                than the whole cache; the message names the numbers.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        check_prompt(request, self.max_model_len)
        check_fits_cache(request, self.max_num_blocks, self.block_size, self.max_model_len,
                         self.num_lookahead_tokens)
        self.structured_outputs.start(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside the step: abort, or a stop string matched.

        Unknown or already finished ids are ignored. Their blocks are freed now;
        the ids reach the runner in the next SchedulerOutput.finished_req_ids.

        Raises:
            ValueError: finished_status is not a finished status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finish_requests needs a finished status, got {finished_status}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed_running: set[Request] = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                removed_running.add(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            if loading:  # the load may still write into its blocks: they wait for its end
                self.connector.abort_load(request)
            self._free_request(request, free_blocks=not loading)
        if removed_running:
            self.running = [r for r in self.running if r not in removed_running]

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """Pick the tokens to compute this step and their KV blocks.

        There are no prefill and decode modes: every request is scheduled up to
        `num_tokens - num_computed_tokens` tokens (a whole prompt, a chunk of
        one, or the one token sampled last step) under one token budget of
        max_num_batched_tokens. Running requests go first, in `running`'s order;
        when blocks run out the last one (newest; priority: worst) is preempted
        (blocks freed, recomputed later). Only if nobody was preempted are waiting
        requests admitted in the queue's order, reusing prefix-cache hits, until the budget,
        max_num_seqs or the free blocks run out.
        """
        budget = self.max_num_batched_tokens
        self.structured_outputs.promote()
        plan = StepPlan(budget, self.prefill_policy.start_step(budget, self.running, self.waiting))
        plan.preempted_req_ids = self.preemption.take_preempted_between_steps()
        self._schedule_running(plan)
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free finished requests.

        Returns:
            One EngineCoreOutput per request with new tokens, prompt logprobs
            or a finish this step (requests still mid-prefill without prompt
            logprobs produce none).

        Raises:
            ValueError: the runner output lacks a scheduled request.
        """
        outputs: list[EngineCoreOutput] = []
        stopped: set[Request] = set()
        mro = model_runner_output
        if mro.kv_connector_output is not None:
            update = self.connector.update(mro.kv_connector_output, self.requests)
            for request in update.loaded:  # scheduled from its loaded prefix on
                request.status = RequestStatus.WAITING
            outputs.extend(self._finish_failed(update.failed))
        outputs.extend(self._finish_failed(self.structured_outputs.take_failed(), grammar=True))
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished (e.g. aborted) while the step ran
            index = mro.req_id_to_index.get(req_id)
            if index is None:
                raise ValueError(f"model runner output has no entry for request {req_id!r}")
            sampled = mro.sampled_token_ids[index]
            # Async scheduling: a request preempted after this step was scheduled
            # still gets the step's token; it waits (PREEMPTED) and may stop here.
            waiting = request.status == RequestStatus.PREEMPTED
            self.spec.settle(request, scheduler_output.scheduled_spec_decode_tokens, sampled,
                             mro.num_draft_tokens and mro.num_draft_tokens[index], waiting)
            new_token_ids, finished = self._append_sampled(request, sampled)
            if mro.spec_token_ids is not None and not finished:
                request.spec_token_ids = mro.spec_token_ids[index]
            output = make_engine_core_output(request, index, new_token_ids, mro)
            if output is not None:
                outputs.append(output)
            if finished:
                if waiting:
                    self.waiting.remove(request)
                else:
                    stopped.add(request)
                kv_transfer_params = self._free_request(request)
                if output is not None:
                    output.kv_transfer_params = kv_transfer_params
        if stopped:
            self.running = [r for r in self.running if r not in stopped]
        return outputs

    # ---- schedule() helpers ----

    def _schedule_running(self, plan: StepPlan) -> None:
        """Continue running requests (decodes and unfinished chunked prefills)."""
        policy = self.prefill_policy
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            to_compute = self._num_tokens_to_compute(request)
            num_new = min(policy.num_new_tokens(to_compute, plan.prefills), plan.token_budget)
            num_new = self.encoder.fit(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                req_index += 1
                continue
            drafts = self.spec.drafts(request, to_compute, plan.token_budget)
            num_new += len(drafts or ())
            new_blocks = self.preemption.allocate_or_preempt(
                self.running, request, num_new, plan.preempted_req_ids)
            if new_blocks is None:
                break  # the request preempted itself; everything after it is gone too
            plan.add(request, num_new)
            if drafts is not None:
                plan.spec_tokens[request.request_id] = drafts
            plan.cached_reqs.append((request, False, [b.block_id for b in new_blocks]))
            policy.note(plan.prefills, to_compute, num_new, policy.is_long(to_compute))
            req_index += 1

    def _num_tokens_to_compute(self, request: Request) -> int:
        """Tokens of a running request not yet scheduled, placeholders included.

        0 when its placeholders already reach max_tokens or max_model_len:
        the step in flight samples its last token, so one more step could only
        produce a token that would be dropped (and need a KV slot past its
        reservation).
        """
        num_placeholders = request.num_output_placeholders
        total = request.num_tokens + num_placeholders
        if num_placeholders and (
            total >= self.max_model_len
            or (request.max_tokens is not None
                and request.num_output_tokens + num_placeholders >= request.max_tokens)
        ):
            return 0
        return total - request.num_computed_tokens

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in the queue's order; stop at the first that does not fit.

        With concurrent partial prefills, a request that would exceed
        max_long_partial_prefills or max_num_partial_prefills is skipped for
        this step (it keeps its place) and the scan goes on; so is a request
        waiting for its KV (WAITING_FOR_REMOTE_KVS) or its grammar
        (WAITING_FOR_FSM), and one whose KV the connector starts loading now.
        """
        kv, policy = self.kv_cache_manager, self.prefill_policy
        skipped: list[Request] = []
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if RequestStatus.waits_in_background(request.status):
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit_tokens, num_external, load_async = self._lookup(request)
            to_compute = request.num_tokens - num_hit_tokens - num_external
            if load_async:  # blocks for everything now; scheduled once the load is done
                num_new_computed = num_hit_tokens - request.num_computed_tokens
                if kv.allocate_slots(request, to_compute, num_new_computed, hits, num_external,
                                     num_lookahead_tokens=self.num_lookahead_tokens) is None:
                    break
                self._start_load(request, num_hit_tokens, num_external)
                skipped.append(self.waiting.pop())
                continue
            num_new = policy.num_new_tokens(to_compute, plan.prefills)
            if num_new > plan.token_budget:
                if not self.enable_chunked_prefill:
                    break  # the whole prompt goes in one step, and not in this one
                num_new = plan.token_budget
            long = policy.is_long(to_compute)
            if policy.over_limits(plan.prefills, long, partial=num_new < to_compute):
                skipped.append(self.waiting.pop())
                continue
            num_new = self.encoder.fit(request, num_hit_tokens, num_new)
            new_blocks = None if num_new == 0 else kv.allocate_slots(
                request, num_new, num_hit_tokens - request.num_computed_tokens, hits,
                num_external, num_lookahead_tokens=self.num_lookahead_tokens,
            )
            if new_blocks is None:
                self.encoder.free(request)
                break
            self.waiting.pop()
            if not request.num_computed_tokens:  # not a finished load: noted at its start
                self._note_allocated(request, num_hit_tokens, num_external)
            self._admit(request, num_hit_tokens + num_external, plan)
            plan.add(request, num_new)
            policy.note(plan.prefills, to_compute, num_new, long)
        self.waiting.prepend_all(skipped)

    def _lookup(self, request: Request) -> tuple[list[KVCacheBlock], int, int, bool]:
        """(prefix-cache hits, their tokens, the connector's tokens after them, whether it
        loads those in the background) for a waiting request. A request whose
        background load finished holds its blocks: its loaded prefix is its hit."""
        if request.num_computed_tokens:
            return [], request.num_computed_tokens, 0, False
        hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        if self.connector is None:
            return hits, num_hit_tokens, 0, False
        return hits, num_hit_tokens, *self.connector.external_tokens(request, num_hit_tokens)

    def _note_allocated(self, request: Request, num_hit_tokens: int, num_external: int) -> None:
        """A looked-up request got its blocks: the connector plans its load, the prompt
        sources count it (first admission only)."""
        if self.connector is not None:
            self.connector.note_allocated(request, num_hit_tokens, num_external)
        if request.num_preemptions == 0:
            computed = request.num_prompt_tokens - num_hit_tokens - num_external
            for source, n in (("local_cache_hit", num_hit_tokens), ("local_compute", computed),
                              ("external_kv_transfer", num_external)):
                self.prompt_tokens_by_source[source] += n

    def _start_load(self, request: Request, num_hit_tokens: int, num_external: int) -> None:
        """The request got its blocks; it waits while the connector loads its KV."""
        self._note_allocated(request, num_hit_tokens, num_external)
        self.connector.start_load(request, num_hit_tokens + num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def _admit(self, request: Request, num_hit_tokens: int, plan: StepPlan) -> None:
        """Move a request that got its blocks from waiting to running."""
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        self.waiting.place_running(self.running, request)
        if resumed:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            plan.cached_reqs.append((request, True, block_ids))
        else:
            plan.new_reqs.append(request)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        """Package the plan, then advance num_computed_tokens past this step's tokens."""
        output = package_plan(plan, self.kv_cache_manager.get_block_ids, self.finished_req_ids)
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            computed = request.num_computed_tokens
            self.num_prefill_tokens += max(
                min(computed + num_tokens, request.num_prompt_tokens) - computed, 0)
            request.num_computed_tokens = computed + num_tokens
            if (self.async_scheduling and request.num_computed_tokens
                    >= request.num_tokens + request.num_output_placeholders):
                # this step samples its next token (async spec: up to 1 + k')
                request.num_output_placeholders += 1 + len(plan.spec_tokens.get(req_id, ()))
        self.finished_req_ids = set()
        output.scheduled_encoder_inputs, output.free_encoder_mm_hashes = (
            self.encoder.step_output())
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_meta(output)
        return output

    # ---- update_from_output() helpers ----

    def _append_sampled(self, request: Request, sampled: list[int]) -> tuple[list[int], bool]:
        """Append sampled tokens one by one until a stop condition hits."""
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if check_stop(request, self.max_model_len):
                return new_token_ids, True
        return new_token_ids, False

    def _free_request(self, request: Request, free_blocks: bool = True) -> dict[str, Any] | None:
        """Free a finished request's blocks (or hand them to the connector to send first;
        `free_blocks=False`: the connector holds them already).

        Returns the connector's kv_transfer_params for the response, if any.
        """
        kv_transfer_params = None
        delay_free = False
        if self.connector is not None:
            delay_free, kv_transfer_params = self.connector.request_finished(request)
        if free_blocks and not delay_free:
            self.kv_cache_manager.free(request)
        self.encoder.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return kv_transfer_params

    def _finish_failed(self, failed: dict[str, str], grammar: bool = False
                       ) -> list[EngineCoreOutput]:
        """Finish requests whose KV load or grammar compile failed (a grammar's error names its
        request field, `source_field`); a load's blocks never entered the prefix cache."""
        outputs = []
        for req_id, reason in failed.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            logger.warning("request %s failed: %s", req_id, reason)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.status = RequestStatus.WAITING  # its load is over: the blocks may go
            self.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            param = request.sampling_params.structured_outputs.source_field if grammar else None
            outputs.append(EngineCoreOutput(
                request_id=req_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                error=f"request {req_id!r} failed: {reason}", error_param=param))
        return outputs

    # ---- queries and cache size ----

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_pending_kv_transfers(self) -> bool:
        """Blocks of finished requests a KV transfer still uses (steps poll for them)."""
        return self.connector is not None and self.connector.has_pending_transfers()

    def prepare_for_sleep(self) -> None:
        """Before the engine sleeps: abort every request, free the blocks held for remote
        readers, forget the prefix cache (the KV contents are about to go)."""
        self.finish_requests(list(self.requests), RequestStatus.FINISHED_ABORTED)
        if self.connector is not None:
            self.connector.sleep()
        self.reset_prefix_cache()

    def has_finished_requests(self) -> bool:
        """Finished ids not yet sent to the runner (a step is still needed to drop them)."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats.of(self)

    @property
    def num_preemptions(self) -> int:
        """Preemptions by recompute since the scheduler was created."""
        return self.preemption.num_preemptions

    @property
    def num_blocks(self) -> int:
        """KV cache blocks including the null block."""
        return self.kv_cache_manager.num_blocks

    @property
    def max_num_blocks(self) -> int:
        """Blocks a request is admitted against: the elastic cache's limit, else the pool's."""
        return self.elastic.limit if self.elastic is not None else self.num_blocks

    def resize_kv_cache(self, num_blocks: int, boundaries: Sequence[int] = ()) -> None:
        """Adopt a new KV block count: the worker committed more, or free tail blocks go.

        The one way the pool's size changes after start-up (the elastic cache, while serving).
        See `BlockPool.resize`: a shrink drops only free tail blocks (cached ones are evicted);
        live blocks never move. The policy records the count and a growth's `boundaries`.

        Raises:
            ValueError: a shrink over a block in use.
        """
        self.kv_cache_manager.resize(num_blocks)
        if self.elastic is not None:
            self.elastic.adopt(num_blocks, boundaries)

    def preempt_for_shrink(self, max_in_use: int, may_preempt: MayPreempt = None) -> int:
        """Preempt (recompute) running requests `may_preempt` allows (None: any), newest first,
        until at most `max_in_use` blocks are in use (an elastic cache's release); the next
        step reports them. Returns how many went (`Preemption.for_shrink`)."""
        return self.preemption.for_shrink(self.running, max_in_use, may_preempt)

    def blocks_in_use_after_preempting(self, max_in_use: int,
                                       may_preempt: MayPreempt = None) -> int:
        """The blocks `preempt_for_shrink(max_in_use, may_preempt)` would leave in use,
        without preempting (same victims, same order: `Preemption.shrink_victims`)."""
        return self.preemption.shrink_victims(self.running, max_in_use, may_preempt)[1]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

