"""The runner's persistent batch: one row per request scheduled this step.

Rows are dense: requests are appended at the end and holes left by finished
or unscheduled requests are filled by moving the last rows down, so row order
is the batch order of the flattened inputs:

    rows:     0      1      2      3
    req:    [ r7 ][ r2 ][ r9 ][ r4 ]   num_reqs = 4
    tokens: token_ids[row, :num_tokens[row]] = prompt + output so far

Per-request state (`CachedRequestState`) outlives its row: a request that is
preempted or not scheduled for a step keeps its tokens and its sampling
generator, and gets a row again when it is next scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.v1.worker.block_table import BlockTable

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose prompt logprobs were already returned (a
    # request resumed after preemption recomputes them; they are not resent).
    num_prompt_logprobs_done: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Dense rows of token ids, counters and block tables for the scheduled requests.

    Args:
        max_num_reqs: most rows (max_num_seqs).
        max_model_len: most tokens a request can hold.
        block_size: tokens per KV block.
        device: the model's device (block table's device copy).
        pin_memory: pin host buffers for asynchronous copies.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(max_num_reqs, max_blocks, block_size, device, pin_memory)
        self.states: list[CachedRequestState] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, state: CachedRequestState) -> int:
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"batch is full ({self.max_num_reqs} requests)")
        row = self.num_reqs
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = row
        n_prompt = state.num_prompt_tokens
        n = state.num_tokens
        if n > self.max_model_len:
            raise ValueError(
                f"request {state.req_id!r} has {n} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.set_row(row, state.block_ids)
        return row

    def remove(self, req_ids: set[str]) -> None:
        """Drop the rows of `req_ids` (those present) and close the holes."""
        rows = sorted(
            (self.req_id_to_index[r] for r in req_ids if r in self.req_id_to_index), reverse=True
        )
        for row in rows:
            last = self.num_reqs - 1
            removed = self.req_ids[row]
            del self.req_id_to_index[removed]
            if row != last:
                self._move(last, row)
            self.req_ids.pop()
            self.states.pop()
            self.block_table.clear_row(last)

    def _move(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.num_tokens[dst] = n
        self.num_prompt_tokens[dst] = self.num_prompt_tokens[src]
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.block_table.move_row(src, dst)
        req_id = self.req_ids[src]
        self.req_ids[dst] = req_id
        self.states[dst] = self.states[src]
        self.req_id_to_index[req_id] = dst

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n >= self.max_model_len:
            # The scheduler stops a request at max_model_len; a token sampled
            # at the last position is returned but has no room to be fed back.
            return
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def rename_blocks(self, states: Iterable[CachedRequestState], moves: dict[int, int]) -> None:
        """Give the requests the new ids of moved KV blocks (old id -> new id in `moves`).

        `states`: every request the runner holds (in the batch or not); the
        block lists are replaced, not edited (a list may be the scheduler
        output's), and the rows in the batch rewritten.
        """
        for state in states:
            if any(b in moves for b in state.block_ids):
                state.block_ids = [moves.get(b, b) for b in state.block_ids]
                row = self.req_id_to_index.get(state.req_id)
                if row is not None:
                    self.block_table.set_row(row, state.block_ids)
