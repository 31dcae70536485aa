"""Logprob gathering: the chosen token's logprob and rank plus the row's top-k.

Used for sample logprobs (the chosen token is the sampled one) and prompt
logprobs (the chosen token is the next prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.outputs import LogprobsLists


@dataclass
class LogprobsTensors:
    """Top logprobs per row, on the device.

    Attributes:
        logprob_token_ids: [N, k+1] int64; column 0 is the chosen token,
            columns 1..k the top-k tokens in descending order.
        logprobs: [N, k+1] float32, matching logprobs.
        selected_token_ranks: [N] int64, the 1-based rank of column 0: the
            number of tokens whose logprob is >= the chosen token's.
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def tolists(self) -> LogprobsLists:
        """Copy to Python lists (one device sync)."""
        return LogprobsLists(
            logprob_token_ids=self.logprob_token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.selected_token_ranks.tolist(),
        )


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks, and each row's top `num_logprobs`.

    Args:
        logprobs: [N, V] float32 log-softmax of the logits.
        num_logprobs: k >= 0 top entries per row.
        token_ids: [N] integer ids of the chosen tokens.

    Raises:
        ValueError: shapes that do not match, or k outside [0, V].
    """
    if logprobs.dim() != 2 or token_ids.shape != (logprobs.shape[0],):
        raise ValueError(
            f"logprobs must be [N, V] and token_ids [N]; got {tuple(logprobs.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    if not 0 <= num_logprobs <= logprobs.shape[1]:
        raise ValueError(f"num_logprobs must be in [0, {logprobs.shape[1]}], got {num_logprobs}")
    chosen = token_ids.to(torch.int64).unsqueeze(1)  # [N, 1]
    chosen_logprobs = logprobs.gather(1, chosen)  # [N, 1]
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        chosen = torch.cat([chosen, top_ids], dim=1)
        chosen_logprobs = torch.cat([chosen_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(chosen, chosen_logprobs.to(torch.float32), ranks)


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of given tokens (prompt logprobs) from raw logits.

    Row m scores `token_ids[m]` under `logits[m]`: for prompt logprobs, the
    logits at position m and the prompt token at position m + 1. Memory is
    M x V x 4 bytes twice over; call it in chunks of positions for long prompts.

    Args:
        logits: [M, V] logits (any float dtype; computed in float32).
        token_ids: [M] token ids to score.
        num_logprobs: top entries per row, k >= 0.
    """
    return gather_logprobs(logits.to(torch.float32).log_softmax(dim=-1), num_logprobs, token_ids)
