"""`DeviceNgramProposer` proposes what `NgramProposer` (numpy, one row at a time) proposes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.worker.ngram_device import NO_DRAFT, DeviceNgramProposer


def _reference(rows: list[np.ndarray], caps: list[int], k: int, lo: int, hi: int):
    ref = NgramProposer(k, lo, hi)
    return [ref.propose(row, cap) for row, cap in zip(rows, caps, strict=True)]


def _device(rows: list[np.ndarray], caps: list[int] | None, k: int, lo: int, hi: int,
            width: int | None = None, fill: int = 7):
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), fill, dtype=torch.int32)  # junk after each row
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.from_numpy(row.astype(np.int32))
    num = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    cap = None if caps is None else torch.tensor(caps, dtype=torch.int64)
    drafts, counts = DeviceNgramProposer(k, lo, hi).propose(ids, num, cap)
    assert drafts.shape == (len(rows), k) and drafts.dtype == torch.int64
    out = []
    for d, c in zip(drafts.tolist(), counts.tolist(), strict=True):
        assert all(t == NO_DRAFT for t in d[c:])
        out.append(d[:c])
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("k", "lo", "hi"), [(4, 2, 5), (3, 1, 3), (5, 3, 3), (2, 1, 6)])
def test_equals_numpy_proposer_on_random_histories(seed, k, lo, hi):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # small vocabularies: matches of every length
    rows = [rng.integers(0, vocab, size=int(rng.integers(1, 80))) for _ in range(16)]
    caps = [int(rng.integers(-1, k + 2)) for _ in rows]
    assert _device(rows, caps, k, lo, hi, fill=int(rng.integers(0, vocab))) == _reference(
        rows, caps, k, lo, hi)
    assert _device(rows, None, k, lo, hi) == _reference(rows, [k] * len(rows), k, lo, hi)


def test_no_match_and_match_at_the_very_end():
    rows = [
        np.arange(30),                           # all distinct: nothing ever matches
        np.array([1, 2, 3, 9, 1, 2, 3]),         # match at 0; continuation 9 1 2 3 (k = 4)
        np.array([5, 6, 5, 6]),                  # match at 0, its continuation runs to the end
        np.array([4, 4]),                        # one-token suffix, the only earlier window
        np.array([8]),                           # too short for any suffix
    ]
    got = _device(rows, None, 4, 1, 3)
    assert got == _reference(rows, [4] * len(rows), 4, 1, 3)
    assert got == [[], [9, 1, 2, 3], [5, 6], [4], []]


def test_longest_suffix_wins_and_earliest_occurrence():
    # suffix "1 2 3" occurs at 4 (n = 3); "2 3" occurs earlier at 0 but shorter loses.
    row = np.array([2, 3, 0, 0, 1, 2, 3, 7, 1, 2, 3])
    assert _device([row], None, 2, 1, 3) == [[7, 1]] == _reference([row], [2], 2, 1, 3)


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DeviceNgramProposer(0, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        DeviceNgramProposer(2, 3, 2)
