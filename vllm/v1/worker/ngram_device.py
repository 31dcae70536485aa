"""`DeviceNgramProposer`: prompt-lookup drafts for a whole batch, on the device, no host sync.

The same rule as `NgramProposer` (vllm/v1/spec_decode/ngram_proposer.py, numpy, one
sequence at a time): for each row, the longest suffix n in [prompt_lookup_min,
prompt_lookup_max] that occurred earlier in the row, at its earliest occurrence,
and the up to k tokens that followed it. Here every row is matched at once with
tensor ops (one `unfold` compare for every n at once), so the proposal can run on the device
right after a step's verification, with no token ids going to the host::

    token_ids [B, L]   a b c d e f x b c d . . .     num_tokens [B] = 10 (row 0)
    n = 3:   windows s = 0 .. L-1-n compared with the suffix "b c d" -> first hit s = 1
    drafts   [B, k]    e f x b                        (-1 past what exists or is allowed)
    num_drafts [B]     4                              (0: no suffix matched)

This is the device half of async scheduling with speculative decoding (see
docs/design.md, "Speculative decoding and async scheduling"): the drafts of step N+1
are proposed from step N's accepted tokens while they are still on the device.
"""

from __future__ import annotations

import torch

from vllm.v1.spec_decode.ngram_proposer import check_lookup_params

# A draft slot with no token (no match, or past the row's tokens or its cap).
NO_DRAFT = -1


class DeviceNgramProposer:
    """Batched n-gram prompt lookup over a device tensor of token histories.

    Args:
        num_speculative_tokens: k, the most drafts a row gets.
        prompt_lookup_min / prompt_lookup_max: suffix lengths tried, longest first.

    Raises:
        ValueError: k < 1, or not 1 <= min <= max.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        check_lookup_params(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: torch.Tensor, num_tokens: torch.Tensor,
                max_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts of every row; all tensor ops on `token_ids`' device (no `.item()`).

        Args:
            token_ids: [B, L] integer token ids; row b's history is
                token_ids[b, :num_tokens[b]], anything after it is ignored.
            num_tokens: [B] int64, each row's history length (0 <= n <= L).
            max_drafts: [B] int64 cap per row below k (room left: max_tokens,
                max_model_len), or None for k.

        Returns:
            (drafts [B, k] int64, NO_DRAFT (-1) past each row's count;
             num_drafts [B] int64 in [0, k], 0 where no suffix matched)
        """
        b, length = token_ids.shape
        device = token_ids.device
        num_tokens = num_tokens.to(torch.int64)
        rows = torch.arange(b, device=device)
        m = self.max_n
        # Every end position e gets the window of the m tokens ending there (m - 1 sentinel
        # ids -1 in front, never equal to a token), compared with the row's last m tokens
        # at once; an occurrence of the n-token suffix ends at e iff the trailing matches
        # of e's window are >= n. One pass for every n (a loop over n launched ~4x more
        # kernels, and launches are what a small model's step is made of).
        ids = torch.nn.functional.pad(token_ids, (m - 1, 0), value=-1)  # its dtype
        windows = ids.unfold(1, m, 1)[:, :length]  # [B, L, m]: window e ends at e
        tail = (num_tokens - m).unsqueeze(1) + torch.arange(m, device=device)
        suffix = ids.gather(1, (tail + m - 1).clamp(min=0, max=length + m - 2))  # [B, m]
        suffix = torch.where(tail >= 0, suffix, -2)  # before the row: matches nothing
        eq = windows == suffix.unsqueeze(1)
        # [B, L] trailing matches (int8 / int32 temporaries: [B, L, m] is the big one)
        trailing = eq.flip(2).to(torch.int8).cumprod(dim=2, dtype=torch.int8).sum(
            dim=2, dtype=torch.int32)
        ends = torch.arange(length, device=device)
        # An end must be earlier than the suffix (e <= num_tokens - 2).
        trailing = torch.where(ends.unsqueeze(0) <= (num_tokens - 2).unsqueeze(1), trailing, 0)
        best = trailing.max(dim=1).values.clamp(max=self.max_n)  # the longest n found
        found = best >= self.min_n
        first = (trailing >= best.unsqueeze(1)).to(torch.int8).argmax(dim=1)  # its earliest
        start = first + 1  # the first draft follows the occurrence's end
        cap = torch.full((b,), self.k, dtype=torch.int64, device=device)
        if max_drafts is not None:
            cap = torch.minimum(cap, max_drafts.to(device=device, dtype=torch.int64))
        offsets = torch.arange(self.k, device=device)
        index = start.unsqueeze(1) + offsets  # [B, k]
        valid = (found.unsqueeze(1) & (index < num_tokens.unsqueeze(1))
                 & (offsets.unsqueeze(0) < cap.unsqueeze(1)))
        drafts = token_ids[rows.unsqueeze(1), index.clamp(max=length - 1)].to(torch.int64)
        drafts = torch.where(valid, drafts, NO_DRAFT)
        return drafts, valid.sum(dim=1)
