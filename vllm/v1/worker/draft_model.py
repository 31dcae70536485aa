"""`DraftModelProposer`: a smaller model with the target's vocabulary proposes k tokens.

Its attention layers are named `draft.<name>` and join the target's in one
`KVCacheConfig` (same blocks, same block ids: block b holds the same tokens'
K/V for both models), so the one KV reservation, its measured sizing and its
growth cover both. Per step::

    target forward (flat batch)  ->  draft forward on the same inputs, same slots
                                     (the draft's KV for every computed token)
    verify / sample              ->  each sampling row's last token at position p
    k draft decode steps            positions p .. p + k - 1 (the scheduler holds
                                     k lookahead slots), one token per row each

Random rows draw drafts from the draft's distribution q (after the request's
temperature / top-k / top-p) and keep q for the verification, which accepts
with min(1, p / q) (see rejection_sampler.py). Eager only (no CUDA graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.sampling_params import _SAMPLING_EPS
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.sample.metadata import build_sampling_metadata
from vllm.v1.sample.ops.topk_topp import apply_top_k_top_p, random_sample
from vllm.v1.worker.input_batch import InputBatch

DRAFT_PREFIX = "draft."


def rename_draft_layers(model: torch.nn.Module) -> None:
    """Prefix the draft's attention layer names so they never collide with the target's."""
    from vllm.model_executor.models.utils import get_attention_layers

    for layer in get_attention_layers(model).values():
        layer.layer_name = DRAFT_PREFIX + layer.layer_name


def attention_layers(model: torch.nn.Module, draft: DraftModelProposer | None) -> dict:
    """Attention layer name -> layer: the target's in layer order, then the draft's
    (`draft.` names). These are the layers of one KV cache config: one layout, one
    block id space, one sizing for both models."""
    from vllm.model_executor.models.utils import get_attention_layers

    layers = get_attention_layers(model)
    if draft is not None:
        layers.update(get_attention_layers(draft.model))
    return layers


class DraftModelProposer:
    """Runs the draft model: its KV for the step's tokens, then k proposals per row.

    Args:
        model: the draft model (forward(input_ids, positions), compute_logits).
        num_speculative_tokens: k.
        vocab_size: V (the target's; the worker checks the draft's equals it).
        device: the models' device.
    """

    def __init__(self, model: torch.nn.Module, num_speculative_tokens: int, vocab_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.device = device
        # req_id -> [k_r, V] float32 draft distributions of its pending drafts (random rows).
        self.draft_probs: dict[str, torch.Tensor] = {}

    def forward_same_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            metadata: AttentionMetadata | None) -> None:
        """The draft's forward over the step's flat tokens (writes its KV; output unused)."""
        with set_forward_context(metadata):
            self.model(input_ids, positions)

    def propose(self, batch: InputBatch, rows: list[int], max_model_len: int,
                skip: set[int]) -> dict[int, list[int]]:
        """k draft tokens for each of `rows` (not in `skip`), autoregressively.

        Returns:
            row -> up to k token ids (capped so no position reaches max_model_len).
        """
        rows = [r for r in rows if r not in skip]
        if not rows:
            return {}
        idx = np.array(rows, dtype=np.int64)
        last = batch.num_tokens[idx].astype(np.int64) - 1  # position of each row's last token
        # Drafts per row: none may put the sequence past max_model_len.
        counts = np.minimum(self.k, max_model_len - 1 - last)
        k = int(counts.max())
        if k <= 0:
            return {}
        states = [batch.states[r] for r in rows]
        md = build_sampling_metadata(
            [s.sampling_params for s in states], [[0]] * len(rows), [[] for _ in rows], {},
            self.vocab_size, self.device,
        )
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        block_table = batch.block_table.device_tensor[torch.from_numpy(idx).to(self.device)]
        tokens = torch.from_numpy(batch.token_ids[idx, last].astype(np.int64)).to(self.device)
        drafted, probs = [], []
        for j in range(k):
            # Rows with fewer drafts run on (clamped) and their extra drafts are dropped.
            pos = np.minimum(last + j, max_model_len - 1)
            hidden = self._decode(tokens, pos, batch, idx, block_table)
            logits = self.model.compute_logits(hidden).to(torch.float32)
            tokens, q = self._sample(logits, md, generators)
            drafted.append(tokens)
            if q is not None:
                probs.append(q)
        drafted_ids = torch.stack(drafted, dim=1).tolist()  # [R, k]
        out = {}
        for i, (row, n) in enumerate(zip(rows, counts.tolist(), strict=True)):
            out[row] = drafted_ids[i][: max(n, 0)]
            if probs:
                self.draft_probs[batch.req_ids[row]] = torch.stack([p[i] for p in probs])
        return out

    def _decode(self, tokens, pos: np.ndarray, batch: InputBatch, idx: np.ndarray,
                block_table: torch.Tensor) -> torch.Tensor:
        n = len(idx)
        positions = torch.from_numpy(pos).to(self.device)
        slots = torch.from_numpy(batch.block_table.slot_mapping(idx, pos)).to(self.device)
        qsl_cpu = torch.arange(n + 1, dtype=torch.int32)
        seq_cpu = torch.from_numpy((pos + 1).astype(np.int32))
        metadata = AttentionMetadata(
            num_actual_tokens=n,
            max_query_len=1,
            query_start_loc=qsl_cpu.to(self.device),
            max_seq_len=int(pos.max()) + 1,
            seq_lens=seq_cpu.to(self.device),
            block_table=block_table,
            slot_mapping=slots,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        with set_forward_context(metadata):
            return self.model(tokens, positions)

    @staticmethod
    def _sample(logits: torch.Tensor, md, generators):
        """Greedy rows: argmax; random rows: a draw from q.

        Returns (tokens [R] int64, q [R, V] float32 or None when all rows are greedy).
        """
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy, None
        is_greedy = md.temperature < _SAMPLING_EPS
        scaled = logits / torch.where(is_greedy, 1.0, md.temperature).unsqueeze(1)
        q = apply_top_k_top_p(scaled, md.top_k, md.top_p).softmax(dim=-1)
        drawn = random_sample(q.clone(), generators)
        return torch.where(is_greedy, greedy, drawn), q

    def take_draft_probs(self, req_ids: list[str], num_draft: list[int]) -> torch.Tensor | None:
        """[R, K, V] draft distributions of these requests' drafts (zeros where none)."""
        found = [self.draft_probs.pop(r, None) for r in req_ids]
        if all(f is None for f in found):
            return None
        k = max(num_draft)
        out = torch.zeros(len(req_ids), k, self.vocab_size, device=self.device)
        for i, (q, n) in enumerate(zip(found, num_draft, strict=True)):
            if q is not None:
                out[i, :n] = q[:n]
            else:
                out[i, :n].fill_(1.0)  # greedy-drafted: q one-hot is irrelevant for greedy rows
        return out

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.draft_probs.pop(r, None)
