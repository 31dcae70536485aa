"""The async spec step's Triton kernels (vllm/v1/worker/async_spec_ops.py) against plain
Python references: the device rows' inputs (feed), the greedy verification, the
history append and the n-gram proposal (checked against the numpy `NgramProposer`).

CPU: every case in one TRITON_INTERPRET=1 subprocess; CUDA (`-m cuda`): the same cases.
Odd sizes: block size 3, histories of 1..67 and 700..1,100 tokens (more than one
proposal block of 512), k 3 and 4, rows in shuffled slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.triton_interpreter import check_result, needs_triton, run_checks, run_interpreted
from vllm.v1.spec_decode.ngram_proposer import NgramProposer


@dataclass(frozen=True)
class Case:
    name: str
    k: int
    min_n: int
    max_n: int
    max_len: int
    num_rows: int
    seed: int


CASES = [
    Case("k4_n2to5_short", 4, 2, 5, 67, 3, 0),
    Case("k3_n1to3_short", 3, 1, 3, 67, 5, 1),
    Case("k4_n2to5_long", 4, 2, 5, 1100, 2, 2),
    Case("k4_one_row", 4, 2, 4, 67, 1, 3),
]
SLOTS = 7


def _state(case: Case, device: str):
    """Random histories over a 5-token vocabulary (matches are common)."""
    from vllm.v1.worker.async_spec_ops import DeviceRowState

    rng = np.random.default_rng(case.seed)
    lo = 700 if case.max_len > 512 else 1
    lens = rng.integers(lo, case.max_len - 2 * case.k - 2, SLOTS)
    hist = rng.integers(0, 5, (SLOTS, case.max_len)).astype(np.int32)
    drafts = rng.integers(0, 5, (SLOTS, case.k))
    num_drafts = rng.integers(0, case.k + 1, SLOTS)
    t = {name: torch.from_numpy(np.ascontiguousarray(a)).to(device)
         for name, a in (("hist", hist), ("hist_len", lens.astype(np.int64)),
                         ("drafts", drafts.astype(np.int64)),
                         ("num_drafts", num_drafts.astype(np.int64)))}
    ops = DeviceRowState(t["hist"], t["hist_len"], t["drafts"], t["num_drafts"],
                         case.min_n, case.max_n)
    slots = rng.permutation(SLOTS)[: case.num_rows].astype(np.int64)
    return rng, ops, slots


def _to(a: np.ndarray, device: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _propose_ref(case: Case, hist: np.ndarray, n: int) -> list[int]:
    return NgramProposer(case.k, case.min_n, case.max_n).propose(hist[:n])


def check_feed(case: Case, device: str) -> None:
    rng, ops, slots = _state(case, device)
    d, block_size, num_batch_rows = case.num_rows, 3, 9
    hist = ops.hist.cpu().numpy()
    hist_len = ops.hist_len.cpu().numpy()
    drafts, num_drafts = ops.drafts.cpu().numpy(), ops.num_drafts.cpu().numpy()
    batch_rows = rng.permutation(num_batch_rows)[:d]
    kp = rng.integers(0, case.k + 1, d)
    host_start = hist_len[slots] - 1 + rng.integers(0, case.k + 1, d)  # optimistic
    first = np.cumsum(kp + 1) - (kp + 1) + 2  # two tokens of another row in front
    blocks = -(-case.max_len // block_size) + 1
    table = rng.integers(1, 1000, (num_batch_rows, blocks)).astype(np.int32)
    seq_lens = rng.integers(1, 1000, num_batch_rows).astype(np.int32)
    n = int(first[-1] + kp[-1] + 3)
    rows = np.zeros((6, d + 3), np.int64)  # a wider row stride than D
    rows[:, :d] = (slots, host_start, batch_rows, kp, first, np.zeros(d, np.int64))
    tensors = [torch.full((n,), -7, dtype=torch.int64, device=device) for _ in range(3)]
    seq_t = torch.from_numpy(seq_lens.copy()).to(device)
    nd = ops.feed_rows(torch.from_numpy(rows.astype(np.int64)).to(device), d,
                       torch.from_numpy(table).to(device), block_size, *tensors, seq_t)
    want = [np.full(n, -7, np.int64) for _ in range(3)]
    want_seq = seq_lens.copy()
    want_nd = []
    for i in range(d):
        s, start = slots[i], hist_len[slots[i]] - 1
        v = min(num_drafts[s], kp[i])
        want_nd.append(v)
        for j in range(kp[i] + 1):
            pos = start + j
            ok = j <= v
            want[0][first[i] + j] = hist[s, start] if j == 0 else (drafts[s, j - 1] if ok else 0)
            want[1][first[i] + j] = pos
            slot = table[batch_rows[i], pos // block_size] * block_size + pos % block_size
            want[2][first[i] + j] = slot if ok else -1
        want_seq[batch_rows[i]] += start - host_start[i]
    assert nd.cpu().tolist() == want_nd
    for got, expected in zip(tensors, want, strict=True):
        assert got.cpu().tolist() == expected.tolist()
    assert seq_t.cpu().tolist() == want_seq.tolist()


def _check_after(case: Case, ops, slots, hist0, len0, tokens) -> None:
    """hist / hist_len after appending `tokens[i]` to slot i, and the next drafts."""
    hist, hist_len = ops.hist.cpu().numpy(), ops.hist_len.cpu().numpy()
    drafts, num_drafts = ops.drafts.cpu().numpy(), ops.num_drafts.cpu().numpy()
    for i, s in enumerate(slots):
        n = len0[s] + len(tokens[i])
        assert hist_len[s] == n
        assert hist[s, len0[s] : n].tolist() == list(tokens[i])
        assert hist[s, : len0[s]].tolist() == hist0[s, : len0[s]].tolist()
        want = _propose_ref(case, hist[s], n)
        assert num_drafts[s] == len(want), (s, num_drafts[s], want)
        assert drafts[s, : len(want)].tolist() == want
        assert (drafts[s, len(want) :] == 0).all()


def check_accept(case: Case, device: str) -> None:
    rng, ops, slots = _state(case, device)
    d = case.num_rows
    hist0, len0 = ops.hist.cpu().numpy().copy(), ops.hist_len.cpu().numpy().copy()
    drafts = ops.drafts.cpu().numpy().copy()  # the kernel proposes over it
    nd = rng.integers(0, case.k + 1, d)
    starts = np.cumsum(nd + 1) - (nd + 1)
    target = rng.integers(0, 5, int((nd + 1).sum()))
    for i in range(d):  # accept a random prefix of the drafts, then (maybe) differ
        keep = rng.integers(0, nd[i] + 1)
        target[starts[i] : starts[i] + keep] = drafts[slots[i], :keep]
    emitted, accepted = ops.accept(*(_to(a, device) for a in (slots, target, starts, nd)),
                                   case.k + 1)
    tokens = []
    for i in range(d):
        a = 0
        while a < nd[i] and drafts[slots[i], a] == target[starts[i] + a]:
            a += 1
        row = list(drafts[slots[i], :a]) + [target[starts[i] + a]]
        tokens.append(row)
        assert accepted[i].item() == a
        assert emitted[i].cpu().tolist() == row + [-1] * (case.k - a)
    _check_after(case, ops, slots, hist0, len0, tokens)


def check_append(case: Case, device: str) -> None:
    rng, ops, slots = _state(case, device)
    d, width = case.num_rows, case.k + 1
    hist0, len0 = ops.hist.cpu().numpy().copy(), ops.hist_len.cpu().numpy().copy()
    counts = rng.integers(0, width + 1, d)
    tokens = rng.integers(0, 5, (d, width))
    ops.append(*(_to(a, device) for a in (slots, tokens, counts)))
    _check_after(case, ops, slots, hist0, len0, [tokens[i, : counts[i]] for i in range(d)])


CHECKS = ((check_feed, CASES), (check_accept, CASES), (check_append, CASES))
NAMES = [f"{check.__name__}-{c.name}" for check, cases in CHECKS for c in cases]


def _named(check, case):
    return type("Named", (), {"name": f"{check.__name__}-{case.name}", "case": case})()


def _run_interpreted_cases() -> dict[str, str]:
    groups = [(lambda named, dev, check=check: check(named.case, dev),
               [_named(check, c) for c in cases]) for check, cases in CHECKS]
    return run_checks(groups, probe=True)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    return run_interpreted("tests.v1.spec_decode.test_async_spec_ops", timeout_s=300)


@needs_triton
@pytest.mark.parametrize("name", NAMES)
def test_interpreted(name: str, interpreted_results: dict[str, str]) -> None:
    check_result(interpreted_results, name)


@pytest.mark.cuda
@pytest.mark.parametrize("check", [c for c, _ in CHECKS], ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cuda(check, case) -> None:
    check(case, "cuda")
