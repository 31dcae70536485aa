"""RejectionSampler: exact for greedy; speculative sampling keeps the target distribution."""

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.metadata import build_sampling_metadata, make_request_generator
from vllm.v1.sample.rejection_sampler import RejectionSampler

V = 6


def _md(params, num_draft):
    rows = [p for p, n in zip(params, num_draft, strict=True) for _ in range(n + 1)]
    return build_sampling_metadata(rows, [[0]] * len(rows), [[] for _ in rows], {}, V, "cpu")


def _one_hot_logits(tokens):
    logits = torch.full((len(tokens), V), -10.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_greedy_accepts_matching_prefix_then_target_token():
    sampler = RejectionSampler()
    greedy = SamplingParams(temperature=0.0)
    drafts = [[1, 2, 3], [4, 4], [], [5]]
    # Target argmax per position: req0 agrees on 1, 2 then says 0 (rejects 3);
    # req1 agrees on both and adds a bonus 2; req2 has no drafts; req3 rejects at once.
    target = [1, 2, 0, 3, 4, 4, 2, 3, 0, 1]
    out = sampler(drafts, _one_hot_logits(target), _md([greedy] * 4, [3, 2, 0, 1]), {})
    assert out == [[1, 2, 0], [4, 4, 2], [3], [0]]


def test_random_one_hot_drafts_keep_the_target_distribution():
    """The first emitted token is distributed as p whatever the draft (Leviathan et al. Thm 1)."""
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0, 0.0])
    n = 40000
    drafts = [[1]] * n  # draft token 1 (p = 0.4) every time
    logits = p.clamp(min=1e-30).log().repeat(2 * n, 1)
    md = _md([SamplingParams(temperature=1.0)] * n, [1] * n)
    out = RejectionSampler()(drafts, logits, md, {})
    first = torch.tensor([o[0] for o in out])
    freq = torch.bincount(first, minlength=V).float() / n
    assert torch.allclose(freq, p, atol=0.01), freq
    # Accepted exactly when the draft survives: about p(1) of the time, then a bonus token.
    accepted = sum(len(o) == 2 for o in out) / n
    assert abs(accepted - 0.4) < 0.01


def test_random_with_draft_probs_keeps_the_target_distribution():
    torch.manual_seed(1)
    p = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    q = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])
    n = 40000
    drafts = torch.multinomial(q, n, replacement=True).tolist()
    logits = p.log().repeat(2 * n, 1)
    md = _md([SamplingParams(temperature=1.0)] * n, [1] * n)
    draft_probs = q.repeat(n, 1, 1)  # [n, 1, V]
    out = RejectionSampler()([[d] for d in drafts], logits, md, {}, draft_probs=draft_probs)
    freq = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float() / n
    assert torch.allclose(freq, p, atol=0.012), freq


def test_seeded_rows_reproducible_and_mixed_with_greedy():
    params = [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0.0)]
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3))

    def run():
        gens = {0: make_request_generator(7, "cpu")}
        return RejectionSampler()([[2, 3], [1]], logits.clone(), _md(params, [2, 1]), gens)

    first, second = run(), run()
    assert first == second
    assert first[1][0] == int(logits[3].argmax()) or first[1] == [1, int(logits[4].argmax())]


def test_all_greedy_host_path_equals_the_tensor_path():
    """An all-greedy batch is verified on the host after one argmax; a batch with one
    random row takes the tensor path: the greedy rows' outputs must be the same."""
    gen = torch.Generator().manual_seed(0)
    num_draft = [4, 0, 3, 4, 1, 2]
    logits = torch.randn(sum(num_draft) + len(num_draft), V, generator=gen)
    argmax = logits.argmax(dim=-1).tolist()
    drafts, start = [], 0
    for i, n in enumerate(num_draft):  # request i copies the target for its first i drafts
        drafts.append([argmax[start + j] if j < i else (argmax[start + j] + 1) % V
                       for j in range(n)])
        start += n + 1
    greedy = SamplingParams(temperature=0.0)
    host = RejectionSampler()(drafts, logits.clone(), _md([greedy] * len(drafts), num_draft), {})
    mixed_params = [greedy] * len(drafts) + [SamplingParams(temperature=1.0)]
    extra = torch.randn(2, V, generator=gen)
    tensor = RejectionSampler()(drafts + [[0]], torch.cat([logits, extra]),
                                _md(mixed_params, num_draft + [1]), {})
    assert host == tensor[:-1]
    assert [len(t) for t in host] == [1, 1, 3, 4, 2, 3]


def test_emitted_on_device_layout_mixed_batch():
    """[R, K + 1]: accepted drafts, the final token, then -1; the lists are its rows."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=0.0)]
    num_draft = [3, 2, 0]
    target = [1, 2, 0, 5, 4, 4, 2, 3]  # greedy req0 accepts 1, 2 and emits 0; req2 emits 3
    logits = _one_hot_logits(target)
    drafts = [[1, 2, 3], [3, 4], []]

    def gens():
        return {1: make_request_generator(3, "cpu")}

    emitted = RejectionSampler().emitted_on_device(drafts, logits.clone(), _md(params, num_draft),
                                                   gens())
    assert emitted.shape == (3, 4) and emitted.dtype == torch.int64
    assert emitted[0].tolist() == [1, 2, 0, -1]
    assert emitted[2].tolist() == [3, -1, -1, -1]
    # Row 1 (random, near one-hot targets 4 4 2): its draft 3 has p ~ e^-28 -> rejected;
    # the residual (p without 3) is ~ one-hot at 4.
    assert emitted[1].tolist() == [4, -1, -1, -1]
    lists = RejectionSampler()(drafts, logits.clone(), _md(params, num_draft), gens())
    assert lists == [[t for t in row if t != -1] for row in emitted.tolist()]
