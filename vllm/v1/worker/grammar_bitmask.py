"""`GrammarBitmask`: the runner's structured-output state, one grammar matcher per request
(xgrammar's `GrammarMatcher` or llguidance's behind the same verbs: the compiled grammar's
`new_matcher()`).

Each step, for the rows that sample::

    matcher(R) catches up with R's output tokens (accepted since the last step)
    bitmask [rows, ceil(V / 32)] int32 (host, pinned): row i = the tokens the grammar
        allows next for R_i (the matcher's fill_next_token_bitmask); -1 (all allowed)
        for an unconstrained row
    -> one copy to the device -> the sampler sets refused logits to -inf
       (xgrammar's apply_token_bitmask_inplace: CUDA / Triton kernel on the GPU,
       a C++ loop on the CPU)

With speculative decoding a request with k drafts gets k + 1 rows: row j is
the mask after drafts 0..j-1, so the rejection sampler refuses a draft the
grammar refuses (its target probability is 0); the matcher is rolled back
after filling, and only the tokens finally emitted are accepted, next step.
EOS is allowed only where the grammar may end (the matcher's stop tokens).
With a reasoning parser (`CompiledGrammar.reasoning`) a reply's reasoning rows
stay all-allowed and the grammar starts after the end tag
(vllm/v1/structured_output/reasoning.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.v1.structured_output.reasoning import BEFORE, CONTENT, REASONING

if TYPE_CHECKING:
    from vllm.v1.structured_output import CompiledGrammar
    from vllm.v1.structured_output.guidance import GuidanceGrammar
    from vllm.v1.worker.input_batch import CachedRequestState

logger = init_logger(__name__)


def _allow(host: torch.Tensor, row: int, token_id: int) -> None:
    """Set token_id's bit in an int32 bitmask row (bit 31 is the sign bit)."""
    bit = token_id % 32
    host[row, token_id // 32] |= (1 << bit) if bit < 31 else -(1 << 31)


class _Matcher:
    """One request's matcher, how many of its output tokens it has seen, and whether the
    reply is still in its reasoning (with `--reasoning-parser`: the grammar applies after
    the end tag, vllm/v1/structured_output/reasoning.py)."""

    def __init__(self, grammar: CompiledGrammar | GuidanceGrammar,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self.matcher = grammar.new_matcher()
        self.reasoning = grammar.reasoning
        self.state = (CONTENT if self.reasoning is None
                      else self.reasoning.state_after(prompt_token_ids))
        self.num_accepted = 0
        self.broken = False  # a token the grammar refused was appended (should not happen)

    @property
    def done(self) -> bool:
        """Past the grammar's end (its stop token accepted; only ignore_eos or a step
        already in flight samples after it) or broken: all-allowed, as in vLLM."""
        return self.broken or self.matcher.is_terminated()

    def catch_up(self, output_token_ids: Sequence[int], req_id: str) -> None:
        for tok in output_token_ids[self.num_accepted:]:
            if self.state != CONTENT:  # the reasoning's tags are not the grammar's
                opened = self.state == REASONING or tok == self.reasoning.start_id
                ended = self.state == REASONING and tok == self.reasoning.end_id
                self.state = REASONING if opened and not ended else CONTENT
                if opened or ended:
                    continue
            if self.matcher.is_terminated():
                break  # tokens after the end (a step already in flight) are dropped
            if not self.broken and not self.matcher.accept_token(tok):
                logger.error("request %s: token %d is outside its grammar; its output is "
                             "no longer constrained", req_id, tok)
                self.broken = True
        self.num_accepted = len(output_token_ids)


class GrammarBitmask:
    """Matchers by request id, and the host / device bitmask buffers.

    Args:
        max_rows: most rows one step masks (max_num_seqs, or x (k + 1) with drafts).
        vocab_size: V, the logits' width.
        device: the logits' device.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.width = -(-vocab_size // 32)
        self.max_rows = max_rows
        # [max_rows, width] int32 each, made on first use: one for the sampled rows, one
        # for the verified drafts (both are filled in one step before their copies ran).
        self._host: list[torch.Tensor | None] = [None, None]
        self.matchers: dict[str, _Matcher] = {}

    def add(self, req_id: str, grammar: CompiledGrammar | GuidanceGrammar,
            prompt_token_ids: Sequence[int] = ()) -> None:
        """A constrained request; its prompt tells whether its reasoning already ended."""
        self.matchers[req_id] = _Matcher(grammar, prompt_token_ids)

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def has_any(self, states: Sequence[CachedRequestState]) -> bool:
        """Whether any of these requests is constrained."""
        return bool(self.matchers) and any(s.req_id in self.matchers for s in states)

    def bitmask(self, states: Sequence[CachedRequestState],
                drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor | None:
        """The step's bitmask on the device, or None when no row is constrained.

        Args:
            states: the requests, in row order; their output ids must be final
                (no async placeholder left).
            drafts: per request, the drafts to verify: request i then takes
                len(drafts[i]) + 1 rows (None: one row each).

        Returns:
            [rows, ceil(V / 32)] int32 on the device.
        """
        if not self.has_any(states):
            return None
        counts = [1] * len(states) if drafts is None else [len(d) + 1 for d in drafts]
        rows = sum(counts)
        host = self._host_buffer(rows, 0 if drafts is None else 1)
        host[:rows].fill_(-1)
        row = 0
        for i, state in enumerate(states):
            m = self.matchers.get(state.req_id)
            if m is not None:
                m.catch_up(state.output_token_ids, state.req_id)
                if not m.done:
                    self._fill_request(m, host, row, drafts[i] if drafts is not None else ())
            row += counts[i]
        return host[:rows].to(self.device, non_blocking=True)

    def _fill_request(self, m: _Matcher, host: torch.Tensor, row: int,
                      drafts: Sequence[int]) -> None:
        """A request's rows by its reasoning state (see _Matcher): CONTENT rows are the
        grammar's; BEFORE, the first row is the grammar's plus the start tag; REASONING
        rows (also after a drafted start tag) stay all-allowed up to a drafted end tag,
        the rows after it are the grammar's."""
        if m.state == CONTENT:
            self._fill(m.matcher, host, row, drafts)
            return
        first = 0
        if m.state == BEFORE:
            if drafts and drafts[0] == m.reasoning.start_id:
                m.matcher.fill_next_token_bitmask(host, row)
                first = 1  # the reasoning opens with draft 0
            else:
                self._fill(m.matcher, host, row, drafts)
            _allow(host, row, m.reasoning.start_id)
            if not first:
                return
        rest = list(drafts[first:])
        if m.reasoning.end_id in rest:
            end = first + rest.index(m.reasoning.end_id) + 1
            self._fill(m.matcher, host, row + end, drafts[end:])

    @staticmethod
    def _fill(matcher, host: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """Rows row .. row + len(drafts): the mask before each draft; a draft the grammar
        refuses ends the walk (the rows after it stay all-allowed: the rejection sampler
        stops at the refused draft anyway). The matcher is rolled back to where it was."""
        matcher.fill_next_token_bitmask(host, row)
        accepted = 0
        for j, tok in enumerate(drafts):
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            accepted += 1
            matcher.fill_next_token_bitmask(host, row + j + 1)
        if accepted:
            matcher.rollback(accepted)

    def _host_buffer(self, rows: int, slot: int) -> torch.Tensor:
        """A pinned host buffer of >= rows rows. Refilled only after its last copy ran:
        the next fill first waits for the step that read it (its sampled ids)."""
        host = self._host[slot]
        if host is None or host.shape[0] < rows:
            host = self._host[slot] = torch.empty(
                (max(rows, self.max_rows), self.width), dtype=torch.int32,
                pin_memory=self.device.type == "cuda")
        return host

