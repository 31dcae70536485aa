"""Test helper: drive a model through a batch schedule or a greedy loop, and the
transformers counterparts used as references."""

from __future__ import annotations

import inspect

import torch

from tests.model_executor.paged_kv import PagedKVHarness

# Per step: (request, new tokens), padding tokens, padding requests.
SCHEDULE = [
    ([("a", 8), ("b", 11)], 0, 0),  # two prefills, a is chunked
    ([("a", 7), ("b", 1)], 3, 1),  # chunked prefill over 8 cached tokens + a decode
    ([("a", 1), ("b", 1), ("c", 9)], 0, 0),  # decodes + a new prefill
    ([("c", 1), ("a", 1), ("b", 1)], 2, 2),
    ([("b", 1), ("c", 5), ("a", 1)], 0, 0),  # decodes around a chunk
    ([("a", 1), ("b", 1), ("c", 1)], 0, 0),
]


def schedule_sequences(vocab_size: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random token sequences, one per request of SCHEDULE, as long as it feeds them."""
    lengths: dict[str, int] = {}
    for batch, _, _ in SCHEDULE:
        for key, n in batch:
            lengths[key] = lengths.get(key, 0) + n
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, vocab_size, (n,), generator=generator) for k, n in lengths.items()}


def run_schedule(
    model, sequences: dict[str, torch.Tensor], block_size: int
) -> dict[str, torch.Tensor]:
    """Feed `sequences` step by step as SCHEDULE says; per request its logits [len, vocab]."""
    harness = PagedKVHarness(model, block_size=block_size, num_blocks=64, seed=1)
    fed = dict.fromkeys(sequences, 0)
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in sequences}
    for batch, pad_tokens, pad_reqs in SCHEDULE:
        step = []
        for name, n in batch:
            step.append((name, sequences[name][fed[name] : fed[name] + n].tolist()))
            fed[name] += n
        for (name, _), out in zip(batch, harness.step(step, pad_tokens, pad_reqs), strict=True):
            logits[name].append(out)
    return {name: torch.cat(parts) for name, parts in logits.items()}


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from our model: one prefill, then decodes through the paged cache."""
    harness = PagedKVHarness(model, block_size=16, num_blocks=16)
    logits = harness.step([("r", prompt)])[0]
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        out.append(int(harness.step([("r", out[-1:])])[0][-1].argmax()))
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from a transformers model, through its own KV cache."""
    # transformers renamed `past_key_values` to `cache` during 5.x; use what this version has.
    params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    device = next(model.parameters()).device
    out, past, step_ids = [], None, torch.tensor([prompt], device=device)
    with torch.no_grad():
        while len(out) < n:
            result = model(input_ids=step_ids, use_cache=True, **{cache_kwarg: past})
            past = getattr(result, cache_kwarg)
            out.append(int(result.logits[0, -1].argmax()))
            step_ids = torch.tensor([out[-1:]], device=device)
    return out
