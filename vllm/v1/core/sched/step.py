"""One step's plan and the outputs packaged from it (torch-free).

    schedule()            StepPlan (budget left, tokens per request, new / cached /
                          preempted requests, drafts) -> package_plan -> SchedulerOutput
    update_from_output()  a request's sampled tokens -> make_engine_core_output
                          -> EngineCoreOutput (None when there is no news)

Both functions only read; the Scheduler advances its own counters after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.partial_prefills import StepPrefills
from vllm.v1.outputs import EngineCoreOutput, ModelRunnerOutput
from vllm.v1.request import Request


@dataclass
class StepPlan:
    """What one `schedule()` call has decided so far."""

    token_budget: int
    prefills: StepPrefills = field(default_factory=StepPrefills)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    # Scheduled requests the runner already holds: (request, resumed, block ids to send).
    cached_reqs: list[tuple[Request, bool, list[int]]] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify

    def add(self, request: Request, num_tokens: int) -> None:
        """Schedule `num_tokens` (>= 1) of `request` this step.

        Every scheduled request runs at least one token: the runner relies on it
        (a step whose total equals its request count is then all decodes).
        """
        if num_tokens < 1:
            raise RuntimeError(
                f"scheduler bug: request {request.request_id} scheduled {num_tokens} tokens"
            )
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens


def package_plan(
    plan: StepPlan, get_block_ids: Callable[[str], list[int]], finished_req_ids: set[str]
) -> SchedulerOutput:
    """The runner's view of the plan: new requests whole, cached ones by what changed.

    Reads each request's num_computed_tokens as it was before this step's tokens.
    """
    new_reqs = [
        NewRequestData(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            sampling_params=r.sampling_params,
            block_ids=get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens,
            grammar=r.grammar,
            mm_features=r.mm_features,
        )
        for r in plan.new_reqs
    ]
    cached = CachedRequestData()
    for request, resumed, block_ids in plan.cached_reqs:
        cached.req_ids.append(request.request_id)
        cached.resumed_from_preemption.append(resumed)
        cached.new_block_ids.append(block_ids)
        cached.num_computed_tokens.append(request.num_computed_tokens)
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
        finished_req_ids=finished_req_ids,
        preempted_req_ids=plan.preempted_req_ids,
        scheduled_spec_decode_tokens=plan.spec_tokens,
    )


def make_engine_core_output(
    request: Request, index: int, new_token_ids: list[int], mro: ModelRunnerOutput
) -> EngineCoreOutput | None:
    """The request's news of this step (tokens, logprobs, prompt logprobs, finish); None if none."""
    prompt_logprobs = mro.prompt_logprobs_dict.get(request.request_id)
    finish_reason = request.get_finished_reason()
    if not new_token_ids and prompt_logprobs is None and finish_reason is None:
        return None
    new_logprobs = None
    if mro.logprobs is not None and new_token_ids:
        new_logprobs = mro.logprobs.slice(index, index + 1)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=new_logprobs,
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time,
    )

