"""`SpecDecodingStats`: draft and acceptance counts (torch-free), as vLLM's.

The scheduler observes one draft per request per step that verified drafts:
k drafted tokens of which a were accepted (a leading run; the token the
target adds after them is not counted). Counts are cumulative since start-up;
the Prometheus logger turns them into `vllm:spec_decode_*` counters and
`SpecDecodingLogging` into the periodic acceptance line.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative speculative-decoding counts.

    Attributes:
        num_spec_tokens: k, the most drafts per request per step.
        num_drafts: verifications (request-steps with >= 1 draft token).
        num_draft_tokens: draft tokens proposed and verified.
        num_accepted_tokens: of which accepted.
        num_accepted_tokens_per_pos: [k] how often the draft at position i
            was accepted (i = 0 is the first draft).
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verification: `num_draft_tokens` drafts, the first `num_accepted_tokens` kept.

        Raises:
            ValueError: accepted > drafted, or drafted > k.
        """
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) "
                f"<= num_speculative_tokens ({self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
            self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos),
        )

    def minus(self, other: SpecDecodingStats | None) -> SpecDecodingStats:
        """The counts since `other` (an earlier copy), for per-interval logging."""
        if other is None:
            return self.copy()
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            [a - b for a, b in zip(self.num_accepted_tokens_per_pos,
                                   other.num_accepted_tokens_per_pos, strict=True)],
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + accepted drafts / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
