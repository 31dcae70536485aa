"""`NgramProposer`: prompt-lookup drafts, no extra model (numpy only).

The idea (Saxena, "Prompt Lookup Decoding", 2023,
https://github.com/apoorvumang/prompt-lookup-decoding; vLLM's `NgramProposer`):
the last n tokens of a sequence often occurred earlier in it (a summary quoting
its source, a code edit copying the code). Find the longest such suffix, n
from `prompt_lookup_max` down to `prompt_lookup_min`, at its earliest earlier
occurrence, and propose the k tokens that followed it::

    context:  a b c d e f ... x b c d      suffix "b c d" (n = 3)
                ^^^^^ match at 1
    proposal:        e f ...               up to k tokens after the match
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to k draft tokens per request by suffix matching.

    Args:
        num_speculative_tokens: k, the most tokens proposed.
        prompt_lookup_min / prompt_lookup_max: suffix lengths tried, longest first.

    Raises:
        ValueError: k < 1, or not 1 <= min <= max.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, context: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Draft tokens for one sequence.

        Args:
            context: [L] integer token ids (prompt + output so far).
            max_tokens: cap below k (room left in the sequence); None = k.

        Returns:
            0..min(k, max_tokens) token ids; [] when no suffix of length
            >= prompt_lookup_min occurred earlier.
        """
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(context)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n:]
            # Windows starting at 0 .. length-n-1: every earlier occurrence,
            # excluding the suffix itself.
            windows = sliding_window_view(context[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return context[start : start + k].tolist()
        return []
