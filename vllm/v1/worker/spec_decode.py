"""The runner's side of speculative decoding: drafts in, verify, propose.

One step of a request with k drafts (the scheduler counts 1 + k tokens)::

    token_ids[row]:  ... t_{n-1} | d_0 ... d_{k-1}      drafts written after num_tokens
    forward:             t_{n-1}   d_0 ... d_{k-1}      k + 1 positions, one pass
    logits:              p_0       p_1 ... p_k          -> RejectionSampler
    output:          d_0 .. d_{a-1} + one target token   (1 .. k + 1 tokens)
    propose:         ngram over the updated tokens -> drafts for the next step

The scheduler rolls num_computed_tokens back past the k - a rejected drafts,
so their KV slots are rewritten next step; nothing here frees anything.

The runner's `execute_model` calls, in this order:

    write_drafts     the drafts into the batch rows (before the inputs are prepared)
    (forward)        the target's; as rows of k + 1 when they fit (verify_rows.py)
    forward_draft    the draft model's over the same flat tokens (draft_model.py)
    verify_step      the rows with drafts: logits at their k + 1 positions ->
                     RejectionSampler -> 1 .. k + 1 emitted tokens each
    (sample)         the other rows, by the runner's sampler
    propose          drafts for the next step
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.metadata import build_sampling_metadata
from vllm.v1.sample.ops.bitmask import apply_bitmask
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.spec_decode.utils import is_spec_decode_unsupported
from vllm.v1.worker.draft_model import DraftModelProposer
from vllm.v1.worker.grammar_bitmask import GrammarBitmask
from vllm.v1.worker.input_batch import InputBatch


class SpecDecoder:
    """Writes drafts into the batch, verifies them, proposes the next ones.

    Args:
        proposer: the draft source: n-gram prompt lookup, or a draft model.
        num_speculative_tokens: k.
        vocab_size: the logits' width.
        device: the model's device.
    """

    def __init__(
        self, proposer: NgramProposer | DraftModelProposer, num_speculative_tokens: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.proposer = proposer
        self.draft = proposer if isinstance(proposer, DraftModelProposer) else None
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.device = device
        self.rejection_sampler = RejectionSampler()

    @staticmethod
    def write_drafts(batch: InputBatch, spec: dict[str, list[int]]) -> None:
        """Put each scheduled request's drafts after its last token (not counted in num_tokens)."""
        for req_id, drafts in spec.items():
            row = batch.req_id_to_index[req_id]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(drafts)] = drafts

    def forward_draft(self, so: SchedulerOutput, input_ids: torch.Tensor,
                      positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """After the target's forward: the draft model's over the same flat tokens (its KV
        for every computed token), once it forgot finished and preempted requests.
        Nothing without a draft model (ngram).

        Args:
            input_ids, positions: [max_num_tokens] the runner's persistent buffers.
        """
        draft = self.draft
        if draft is None:
            return
        draft.forget(so.finished_req_ids | so.preempted_req_ids)
        total = metadata.num_actual_tokens
        draft.forward_same_inputs(input_ids[:total], positions[:total], metadata)

    def verify_step(
        self, model: torch.nn.Module, hidden: torch.Tensor, batch: InputBatch,
        sampling_rows: np.ndarray, num_sched: np.ndarray, spec: dict[str, list[int]],
        output: ModelRunnerOutput, grammar: GrammarBitmask | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Verify the drafts of the sampling rows that carry them; the emitted tokens go
        into `output`, the request states and the batch rows.

        Args:
            sampling_rows: [n] the batch rows that sample this step.
            spec: the step's drafts by request id (non-empty).
            grammar: the structured-output matchers: a draft a request's grammar
                refuses is rejected.

        Returns:
            ([m] the rows left to the sampler, [n] bool: which sampling rows verified).
        """
        is_verify = np.array([batch.req_ids[r] in spec for r in sampling_rows], dtype=bool)
        rows = sampling_rows[~is_verify]
        if is_verify.any():
            verify_rows = sampling_rows[is_verify].tolist()
            emitted = self.verify(model, hidden, batch, verify_rows, num_sched, spec, grammar)
            for row, tokens in zip(verify_rows, emitted, strict=True):
                output.sampled_token_ids[row] = tokens
                batch.states[row].output_token_ids.extend(tokens)
                for tok in tokens:
                    batch.append_token(row, tok)
        return rows, is_verify

    def verify(
        self, model: torch.nn.Module, hidden: torch.Tensor, batch: InputBatch,
        rows: list[int], num_sched: np.ndarray, spec: dict[str, list[int]],
        grammar: GrammarBitmask | None = None,
    ) -> list[list[int]]:
        """Tokens emitted by each of `rows` (requests with drafts this step).

        Args:
            hidden: [num_tokens, hidden_size] this step's hidden states.
            rows: batch rows whose request has drafts in `spec`.
            num_sched: [num_reqs] tokens scheduled per row (1 + k_r for these).
        """
        ends = np.cumsum(num_sched)
        drafts = [spec[batch.req_ids[r]] for r in rows]
        idx = np.concatenate(
            [np.arange(ends[r] - len(d) - 1, ends[r]) for r, d in zip(rows, drafts, strict=True)]
        )
        if len(idx) and idx[-1] - idx[0] + 1 == len(idx):  # one run: every row verifies
            rows_hidden = hidden[int(idx[0]) : int(idx[-1]) + 1]
        else:  # no stream sync: the copy queues behind the forward
            rows_hidden = hidden[torch.from_numpy(idx).to(self.device, non_blocking=True)]
        logits = model.compute_logits(rows_hidden)
        states = [batch.states[r] for r in rows]
        # Row j of a request: the grammar's mask after its drafts 0..j-1 (refused -> -inf).
        bitmask = None if grammar is None else grammar.bitmask(states, drafts)
        if bitmask is not None:
            logits = logits.to(torch.float32)
            apply_bitmask(logits, bitmask)
        params = [s.sampling_params for s, d in zip(states, drafts, strict=True)
                  for _ in range(len(d) + 1)]
        metadata = build_sampling_metadata(
            params, [[0]] * len(params), [[] for _ in params], {}, self.vocab_size, self.device
        )
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        draft_probs = None
        if self.draft is not None and not metadata.all_greedy:
            draft_probs = self.draft.take_draft_probs(
                [batch.req_ids[r] for r in rows], [len(d) for d in drafts]
            )
        return self.rejection_sampler(drafts, logits, metadata, generators, draft_probs)

    def propose(self, batch: InputBatch, rows: list[int], max_model_len: int) -> list[list[int]]:
        """Drafts for the next step, one list per batch row ([] for rows not in `rows`)."""
        out: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        if self.draft is not None:
            skip = {r for r in rows if is_spec_decode_unsupported(batch.states[r].sampling_params)}
            for row, tokens in self.draft.propose(batch, rows, max_model_len, skip).items():
                out[row] = tokens
            return out
        for row in rows:
            state = batch.states[row]
            if is_spec_decode_unsupported(state.sampling_params):
                continue
            n = int(batch.num_tokens[row])
            out[row] = self.proposer.propose(batch.token_ids[row, :n], max_model_len - n)
        return out

    def max_verify_positions(self, max_num_reqs: int, max_num_tokens: int) -> int:
        """Most positions one step can verify: every request decoding with k drafts,
        within the token budget: min(max_num_seqs x (k + 1), max_num_batched_tokens)."""
        return min(max_num_reqs * (self.k + 1), max_num_tokens)

    @torch.inference_mode()
    def dummy_verify_run(self, model: torch.nn.Module, hidden: torch.Tensor,
                         num_positions: int) -> None:
        """The worst-case verification: logits over `num_positions` positions + the sampler.

        The positions are split into requests of k + 1 (the last one shorter).
        Random sampling with top-k / top-p: the sort, softmax and residual
        temporaries are the largest allocations.
        """
        per_req = self.k + 1
        sizes = [per_req] * (num_positions // per_req)
        if num_positions % per_req:
            sizes.append(num_positions % per_req)
        idx = torch.arange(num_positions, device=self.device) % hidden.shape[0]
        logits = model.compute_logits(hidden[idx])
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        metadata = build_sampling_metadata(
            [params] * num_positions, [[0]] * num_positions,
            [[] for _ in range(num_positions)], {}, self.vocab_size, self.device,
        )
        drafts = [[0] * (n - 1) for n in sizes]
        draft_probs = None
        if self.draft is not None:  # the draft distributions kept between steps
            draft_probs = torch.rand(len(sizes), self.k, self.vocab_size, device=self.device)
        self.rejection_sampler(drafts, logits, metadata, {}, draft_probs)
