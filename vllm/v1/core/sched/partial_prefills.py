"""How the prefills of one step share its token budget (vLLM's concurrent partial prefills).

vLLM's flags, their semantics here:

    --max-num-partial-prefills P     most requests left mid-prefill at once
    --max-long-partial-prefills L    most *long* prompts prefilled in one step (L <= P)
    --long-prefill-token-threshold T a request with more than T tokens to compute is long

With P = 1 a prefill may take the whole budget, so a short prompt that arrives
during a long prefill waits for all of it (vLLM V1's behaviour; T, when set,
caps each request at T tokens a step). With P > 1 (vLLM V0's algorithm):

    share = (max_num_batched_tokens - running decodes) // k,
    k = prefills that can run this step (running ones mid-prefill, then waiting
        ones in order, long ones beyond L skipped), 1 <= k <= P

and each prefill computes at most `share` tokens, so the short prompt is
admitted the next step with its whole prompt and samples its first token
there. Alone, a prefill still gets the whole budget. The limits count
prefills left unfinished at the end of the step: a waiting prompt that this
step would leave as the (L+1)-th long or (P+1)-th partial prefill is skipped
for the step and keeps its place, so shorter prompts behind it go first; a
prompt that fits whole in its share is always admitted (a batch of prompts
starts in one step, as in vLLM V1). T left at 0 means
4 % of max_model_len (vLLM's rule) for telling long from short, without a cap.

Example (budget 512, a 3000-token prompt running, a 30-token chat arrives):

    P = 1:  long 512 | long 512 | long 512 | long 512 | long 440 + chat 30   (5 steps)
    P = 4:  long 256 + chat 30 | long 511 + chat 1 | ...                       (1 step)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.logger import init_logger
from vllm.v1.request import Request

logger = init_logger(__name__)

# vLLM's long-prompt threshold when concurrent partial prefills are on and none
# was given: 4 % of max_model_len (vLLM's SchedulerConfig).
DEFAULT_LONG_PREFILL_FRACTION = 0.04


@dataclass
class StepPrefills:
    """One step's prefill bookkeeping."""

    share: int = 0  # most tokens one prefill may take; 0 = no share (P = 1)
    num_partial: int = 0  # prefills left unfinished after this step
    num_long: int = 0  # long prefills left unfinished after this step


class PartialPrefills:
    """The partial-prefill limits and the budget share (plain ints, no config objects).

    Raises:
        ValueError: a limit < 1, L > P, P > 1 without chunked prefill, or
            (P > 1) T > max_model_len; the message names the values.
    """

    def __init__(
        self,
        max_num_partial_prefills: int,
        max_long_partial_prefills: int,
        long_prefill_token_threshold: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
    ) -> None:
        _check(max_num_partial_prefills, max_long_partial_prefills, long_prefill_token_threshold,
               max_model_len, enable_chunked_prefill)
        self.max_num_partial_prefills = max_num_partial_prefills
        self.max_long_partial_prefills = max_long_partial_prefills
        self.cap = long_prefill_token_threshold  # tokens a step per request; 0 = no cap
        self.long_threshold = long_prefill_token_threshold  # tokens; 0 = nothing is long
        if max_num_partial_prefills > 1 and long_prefill_token_threshold == 0:
            self.long_threshold = int(max_model_len * DEFAULT_LONG_PREFILL_FRACTION)

    def log(self) -> None:
        """One INFO line when concurrent partial prefills are on (nothing otherwise)."""
        if self.concurrent:
            logger.info(
                "Concurrent partial prefills: max_num_partial_prefills=%d, "
                "max_long_partial_prefills=%d, prompts over %d tokens count as long%s",
                self.max_num_partial_prefills, self.max_long_partial_prefills,
                self.long_threshold,
                f" and compute at most {self.cap} tokens a step" if self.cap else "",
            )

    @property
    def concurrent(self) -> bool:
        return self.max_num_partial_prefills > 1

    def is_long(self, to_compute: int) -> bool:
        return 0 < self.long_threshold < to_compute

    def start_step(
        self, budget: int, running: Iterable[Request], waiting: Iterable[Request]
    ) -> StepPrefills:
        """The step's bookkeeping, with the share of each prefill (see the module doc)."""
        if not self.concurrent:
            return StepPrefills()
        num_decodes = num_prefills = num_long = 0
        for request in running:
            to_compute = request.num_tokens - request.num_computed_tokens
            if to_compute <= 1:
                num_decodes += 1
            else:
                num_prefills += 1
                num_long += self.is_long(to_compute)
        for request in waiting:
            if num_prefills >= self.max_num_partial_prefills:
                break
            if self.is_long(request.num_tokens - request.num_computed_tokens):
                if num_long >= self.max_long_partial_prefills:
                    continue
                num_long += 1
            num_prefills += 1
        num_prefills = min(max(num_prefills, 1), self.max_num_partial_prefills)
        return StepPrefills(share=max(1, (budget - num_decodes) // num_prefills))

    def num_new_tokens(self, to_compute: int, step: StepPrefills) -> int:
        """Tokens to schedule of `to_compute`: capped by T (if given) and the share."""
        num_new = to_compute
        if 0 < self.cap < num_new:
            num_new = self.cap
        if step.share:
            num_new = min(num_new, step.share)
        return num_new

    def over_limits(self, step: StepPrefills, long: bool, partial: bool) -> bool:
        """Would admitting this waiting prefill exceed L long or P partial prefills?

        Only a prefill that this step leaves unfinished (`partial`) counts: a
        prompt, long or short, that fits whole in its share is admitted. (Counting
        those too admitted one "long" prompt a step, so a batch of 32 prompts over
        4 % of max_model_len took 32 mixed, uncaptured steps to start: the 8B
        shape's batch-32 throughput fell from 4510 to 1052 tokens/s on the H200.)
        """
        if not self.concurrent or not partial:
            return False  # one partial prefill at a time: the budget alone decides (vLLM V1)
        if long and step.num_long >= self.max_long_partial_prefills:
            return True
        return step.num_partial >= self.max_num_partial_prefills

    @staticmethod
    def note(step: StepPrefills, to_compute: int, num_new: int, long: bool) -> None:
        """Count a scheduled prefill that stays unfinished (finished ones and decodes do not)."""
        if num_new < to_compute:
            step.num_partial += 1
            step.num_long += long


def _check(max_partial: int, max_long: int, threshold: int, max_model_len: int,
           chunked: bool) -> None:
    """vLLM's rules for the partial-prefill settings."""
    for name, value in (("max_num_partial_prefills", max_partial),
                        ("max_long_partial_prefills", max_long)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0, got {threshold}")
    if max_long > max_partial:
        raise ValueError(
            f"max_long_partial_prefills ({max_long}) must be <= max_num_partial_prefills "
            f"({max_partial})"
        )
    if not chunked and (max_partial > 1 or threshold > 0):
        what = (f"max_num_partial_prefills={max_partial}" if max_partial > 1 else
                f"long_prefill_token_threshold ({threshold}) splits prompts and")
        raise ValueError(f"{what} needs chunked prefill, which is disabled")
    if max_partial > 1 and threshold > max_model_len:
        raise ValueError(
            f"long_prefill_token_threshold ({threshold}) must be <= max_model_len "
            f"({max_model_len})"
        )
