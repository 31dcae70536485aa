"""Presence, frequency and repetition penalties, batched over rows on the device.

Semantics (one row, token t, logit x):
- repetition (HF `RepetitionPenaltyLogitsProcessor`, CTRL paper, Keskar et
  al. 2019): if t occurs in the prompt or the output, x / r when x > 0, else x * r.
- frequency (OpenAI API): x - f * count(t in output).
- presence (OpenAI API): x - p * [t in output].
Repetition is applied first, then frequency and presence, as in vLLM.
"""

from __future__ import annotations

import torch

from vllm.v1.sample.metadata import pad_token_lists


def _token_presence(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: which ids occur in each row of `token_ids` ([N, L], padded with V)."""
    seen = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device
    )
    seen.scatter_(1, token_ids, True)
    return seen[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalise `logits` in place and return them.

    Args:
        logits: [N, V] float32.
        prompt_token_ids: [N, P] int64, padded with V.
        output_token_ids: [N] lists of generated token ids.
        presence_penalties, frequency_penalties, repetition_penalties: [N] float32.
    """
    num_rows, vocab_size = logits.shape
    output = pad_token_lists(output_token_ids, vocab_size, logits.device)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output, torch.ones_like(output, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    in_output = counts > 0

    repeated = _token_presence(prompt_token_ids, vocab_size) | in_output
    factor = torch.where(repeated, repetition_penalties.unsqueeze(1), 1.0)
    logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits -= frequency_penalties.unsqueeze(1) * counts
    logits -= presence_penalties.unsqueeze(1) * in_output.to(logits.dtype)
    return logits
