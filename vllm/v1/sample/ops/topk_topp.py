"""Truncation (min-p, top-k, top-p) and the random draw, batched over rows.

Everything masks logits to -inf rather than renormalising: the softmax that
follows renormalises over what is left.
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens less likely than min_p x the row's top probability, in place.

    Source: "Turning Up the Heat: Min-p Sampling" (Nguyen et al., 2024).
    Args:
        logits: [N, V] float32 (already temperature-scaled).
        min_p: [N] float32 in [0, 1]; 0 leaves the row unchanged.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top-k tokens, then the smallest prefix holding top_p of the mass.

    One descending sort serves both: top-k keeps sorted positions < k (exactly
    k tokens, ties broken by the sort), top-p keeps positions whose *exclusive*
    cumulative probability (the mass strictly before them) is < p, so the
    first token always survives and the kept set is the minimal one reaching p.
    Top-p is taken over the top-k survivors, as in vLLM and HF.

    Args:
        logits: [N, V] float32.
        top_k: [N] int64 in [1, V] (V = off), or None.
        top_p: [N] float32 in (0, 1] (1 = off), or None.

    Returns:
        A new [N, V] tensor with the dropped tokens at -inf.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        position = torch.arange(vocab_size, device=logits.device)
        drop |= position.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # p == 1 is "off": float rounding can push the running sum to 1.0
        # before the tail, which must not drop tail tokens.
        active = (top_p < 1.0).unsqueeze(1)
        drop |= active & (mass_before >= top_p.unsqueeze(1))
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row: argmax(probs / E) with E ~ Exponential(1) i.i.d.

    P(argmax = i) = p_i / sum(p) (the "exponential race": the minimum of
    independent Exp(rate p_i) variables E_i / p_i is the i-th with probability
    proportional to p_i), so no cumulative sum or CPU sync is needed.
    Each seeded row draws its V exponentials from its own generator, so its
    token depends only on its seed, its step and its probabilities, never on
    the batch around it; other rows use the global generator.

    Args:
        probs: [N, V] float32, rows summing to 1 (zeros where masked);
            overwritten (divided by the noise in place).
        generators: row -> torch.Generator on probs' device.

    Returns:
        [N] int64 token ids.
    """
    noise = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # Exponential draws of exactly 0 would make 0/0 = NaN on masked tokens.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)
