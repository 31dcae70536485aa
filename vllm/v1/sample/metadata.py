"""`SamplingMetadata`: the per-row sampling settings of one step, as device tensors.

Built every step by `build_sampling_metadata` from the scheduled requests'
`SamplingParams`; a tensor is None when no row uses its feature, so the
sampler skips that work entirely (the common all-greedy batch touches only
`argmax`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplingMetadata:
    """Sampling settings for a batch of N rows (one row per request that samples).

    Attributes:
        temperature: [N] float32 raw temperatures (rows < 1e-5 are greedy);
            None when every row is greedy.
        all_greedy: every row is greedy.
        all_random: no row is greedy.
        top_p: [N] float32 in (0, 1], 1.0 = off; None when no row uses it.
        top_k: [N] int64 in [1, V], V = off; None when no row uses it.
        min_p: [N] float32 in [0, 1], 0.0 = off; None when no row uses it.
        generators: row -> that request's seeded torch.Generator (on the
            logits' device). Rows not listed draw from the global generator.
            Only list rows whose sample is kept: a generator advances on
            every draw, so a discarded draw (a partial prefill) would shift
            the request's random stream.
        max_num_logprobs: the most top logprobs any row asked for, or None
            when no row asked (rows asking fewer slice their own).
        no_penalties: no row uses presence / frequency / repetition penalties.
        presence_penalties, frequency_penalties: [N] float32; None with no_penalties.
        repetition_penalties: [N] float32; None with no_penalties.
        prompt_token_ids: [N, max_prompt_len] int64 padded with V (the vocab
            size, an id no token has); None with no_penalties.
        output_token_ids: per row, the tokens generated so far (before this step).
        min_tokens: ([M] int64 rows, [M] int64 token ids) whose logits are set to
            -inf because the row has generated fewer than `min_tokens` tokens
            and the token would stop it; None when nothing is masked.
        logit_bias: ([M] int64 rows, [M] int64 token ids, [M] float32 biases)
            added to the logits; None when no row has a bias.
        allowed_token_ids: ([M] int64 rows, [M, V] bool: the tokens each may sample)
            for the rows with `allowed_token_ids`; the others' logits become -inf;
            None when no row restricts.
        bad_words: ([M] int64 rows, [M] int64 token ids) set to -inf: the one-token
            bad words, and the last token of a longer one whose other tokens end
            the output so far; None when nothing is masked.
        grammar_bitmask: [N, ceil(V / 32)] int32, bit j of row i set = token j is
            allowed by row i's structured-output grammar (all bits set for an
            unconstrained row); refused tokens' logits become -inf before
            anything else (logprobs included, as in vLLM). None: no row is constrained.
    """

    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]
    min_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    grammar_bitmask: torch.Tensor | None = None
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.output_token_ids)


def make_request_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator of a seeded request (`SamplingParams.seed`)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def pad_token_lists(
    token_lists: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """[N, max_len] int64 on `device`, rows right-padded with `pad_id`."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), pad_id, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        if tokens:
            padded[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    return padded.to(device, non_blocking=True)


def _row_tensor(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def build_sampling_metadata(
    sampling_params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Gather one step's per-row settings into a `SamplingMetadata` on `device`.

    Args:
        sampling_params: [N] the params of each row's request.
        prompt_token_ids: [N] each row's prompt (read only when penalties are used).
        output_token_ids: [N] each row's generated tokens so far (the list is
            kept by reference; build anew each step).
        generators: row -> seeded generator, see `SamplingMetadata.generators`.
        vocab_size: V, the logits' width.
        device: where the tensors go (the logits' device).

    Raises:
        ValueError: mismatched lengths, or a generator for a row outside [0, N).
    """
    _check_rows(sampling_params, prompt_token_ids, output_token_ids, generators)
    greedy = [p.sampling_type == SamplingType.GREEDY for p in sampling_params]
    all_greedy, all_random = all(greedy), not any(greedy)
    temperature = None
    if not all_greedy:
        temperature = _row_tensor([p.temperature for p in sampling_params], torch.float32, device)
    no_penalties, penalties, prompt_tensor = _penalties(
        sampling_params, prompt_token_ids, vocab_size, device
    )
    top_p, top_k, min_p = _truncation(sampling_params, greedy, vocab_size, device)
    asked = [p.logprobs for p in sampling_params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        generators=generators,
        max_num_logprobs=max(asked) if asked else None,
        no_penalties=no_penalties,
        presence_penalties=penalties[0],
        frequency_penalties=penalties[1],
        repetition_penalties=penalties[2],
        prompt_token_ids=prompt_tensor,
        output_token_ids=output_token_ids,
        min_tokens=_min_tokens_mask(sampling_params, output_token_ids, vocab_size, device),
        logit_bias=_logit_bias(sampling_params, vocab_size, device),
        allowed_token_ids=_allowed_token_ids(sampling_params, vocab_size, device),
        bad_words=_bad_words(sampling_params, output_token_ids, vocab_size, device),
    )


def _check_rows(sampling_params, prompt_token_ids, output_token_ids, generators) -> None:
    """Raise ValueError unless every per-row input has N entries and every generator's
    row is in [0, N)."""
    n = len(sampling_params)
    if len(prompt_token_ids) != n or len(output_token_ids) != n:
        raise ValueError(
            f"sampling_params ({n}), prompt_token_ids ({len(prompt_token_ids)}) and "
            f"output_token_ids ({len(output_token_ids)}) must have one entry per row"
        )
    bad_rows = [r for r in generators if not 0 <= r < n]
    if bad_rows:
        raise ValueError(f"generators has rows {bad_rows} outside the batch of {n} rows")


def _penalties(sampling_params, prompt_token_ids, vocab_size, device):
    """(no_penalties, [presence, frequency, repetition] [N] float32 or Nones, the padded
    prompts [N, max_prompt_len] int64 or None): tensors only when some row uses a penalty."""
    no_penalties = all(
        p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
        for p in sampling_params
    )
    if no_penalties:
        return True, [None, None, None], None
    penalties = [
        _row_tensor([getattr(p, name) for p in sampling_params], torch.float32, device)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    ]
    return False, penalties, pad_token_lists(prompt_token_ids, vocab_size, device)


def _truncation(sampling_params, greedy: list[bool], vocab_size: int, device):
    """(top_p, top_k, min_p) [N] tensors, each None when no random row uses it (greedy
    rows ignore truncation, so they never make one needed)."""

    def optional(values: list, off, dtype: torch.dtype) -> torch.Tensor | None:
        used = any(v != off for v, g in zip(values, greedy, strict=True) if not g)
        return _row_tensor(values, dtype, device) if used else None

    return (
        optional([p.top_p for p in sampling_params], 1.0, torch.float32),
        optional([min(p.top_k, vocab_size) or vocab_size for p in sampling_params],
                 vocab_size, torch.int64),
        optional([p.min_p for p in sampling_params], 0.0, torch.float32),
    )


def _min_tokens_mask(sampling_params, output_token_ids, vocab_size, device):
    rows, cols = [], []
    for row, (p, out) in enumerate(zip(sampling_params, output_token_ids, strict=True)):
        if len(out) < p.min_tokens:
            stop_ids = sorted(t for t in p.all_stop_token_ids if t < vocab_size)
            rows += [row] * len(stop_ids)
            cols += stop_ids
    if not rows:
        return None
    return _row_tensor(rows, torch.int64, device), _row_tensor(cols, torch.int64, device)


def _allowed_token_ids(sampling_params, vocab_size, device):
    rows = [row for row, p in enumerate(sampling_params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = [t for t in sampling_params[row].allowed_token_ids if t < vocab_size]
        allowed[i, ids] = True
    return _row_tensor(rows, torch.int64, device), allowed.to(device, non_blocking=True)


def _bad_words(sampling_params, output_token_ids, vocab_size, device):
    rows, cols = [], []
    for row, (p, out) in enumerate(zip(sampling_params, output_token_ids, strict=True)):
        for word in p.bad_words_token_ids if p.bad_words else ():
            *prefix, last = word
            if last < vocab_size and (not prefix or list(out[-len(prefix):]) == prefix):
                rows.append(row)
                cols.append(last)
    if not rows:
        return None
    return _row_tensor(rows, torch.int64, device), _row_tensor(cols, torch.int64, device)


def _logit_bias(sampling_params, vocab_size, device):
    rows, cols, vals = [], [], []
    for row, p in enumerate(sampling_params):
        for tok, bias in (p.logit_bias or {}).items():
            if tok >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {tok} is outside the vocabulary (vocab_size {vocab_size})"
                )
            rows.append(row)
            cols.append(tok)
            vals.append(float(bias))
    if not rows:
        return None
    return (_row_tensor(rows, torch.int64, device), _row_tensor(cols, torch.int64, device),
            _row_tensor(vals, torch.float32, device))

