"""What the model runner returns to the scheduler each step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogprobsLists:
    """Top logprobs per row, as Python lists.

    Row r: `logprob_token_ids[r][0]` is the token the logprobs are about (the
    sampled token, or the next prompt token for prompt logprobs) and
    `logprobs[r][0]` its logprob; entries 1..k are the top-k tokens in
    descending order. `ranks[r]` is the 1-based rank of entry 0 in the vocab.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # scheduled requests, in the runner's batch order
    req_id_to_index: dict[str, int]
    # One list per request: the tokens sampled this step ([] while a prefill
    # is still partial, i.e. no token was sampled).
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None  # rows aligned with req_ids
    # req_id -> prompt logprobs of the prompt positions computed this step.
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
