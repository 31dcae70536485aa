"""Sampler: greedy, truncation, seeded draws, penalties, logprobs, distribution.

Every test runs on the CPU and, with a GPU, on CUDA (`cuda` marker). Random
draws are made deterministic with fixed seeds.
"""

import math

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logprobs import compute_token_logprobs, gather_logprobs
from vllm.v1.sample.metadata import build_sampling_metadata, make_request_generator
from vllm.v1.sample.ops.topk_topp import apply_min_p, apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def metadata(params, device, *, prompts=None, outputs=None, generators=None, vocab=None):
    n = len(params)
    return build_sampling_metadata(
        params,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        generators or {},
        vocab,
        device,
    )


def sample(logits, params, device, **kw):
    md = metadata(params, device, vocab=logits.shape[1], **kw)
    return Sampler()(logits.clone(), md)


def random_logits(n, v, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = random_logits(8, 50, device)
    out = sample(logits, [SamplingParams(temperature=0)] * 8, device)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs_tensors is None


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_and_tiny_top_p_equal_greedy(device):
    torch.manual_seed(0)
    logits = random_logits(16, 100, device, seed=1)
    greedy = logits.argmax(-1)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                   SamplingParams(min_p=1.0, temperature=1.3)):
        assert torch.equal(sample(logits, [params] * 16, device).sampled_token_ids, greedy)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_random_rows(device):
    torch.manual_seed(0)
    logits = random_logits(6, 40, device, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1)] * 3
    params[1] = SamplingParams(temperature=0.8, top_k=1)
    out = sample(logits, params, device).sampled_token_ids
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_top_p_masks_exactly():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # sorted order: 1, 3, 2, 0
    logits = probs.log()
    kept = lambda k, p: torch.isfinite(apply_top_k_top_p(
        logits.clone(), None if k is None else torch.tensor([k]),
        None if p is None else torch.tensor([p]))).nonzero()[:, 1].tolist()
    assert kept(None, 0.75) == [1, 3]  # 0.5 < 0.75 <= 0.8
    assert kept(None, 0.85) == [1, 2, 3]
    assert kept(None, 1.0) == [0, 1, 2, 3]
    assert kept(3, None) == [1, 2, 3]
    assert kept(None, 0.55) == [1, 3]
    # top-p over the top-k survivors: renormalised 0.625 / 0.375, so 0.55 keeps one.
    assert kept(2, 0.55) == [1]
    out = apply_top_k_top_p(logits.clone(), torch.tensor([3]), None)
    assert torch.equal(out[0, 1:], logits[0, 1:])  # survivors keep their logits


def test_min_p_masks_exactly():
    probs = torch.tensor([[0.4, 0.3, 0.19, 0.11], [0.4, 0.3, 0.19, 0.11]])
    out = apply_min_p(probs.log(), torch.tensor([0.5, 0.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # < 0.2 dropped
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_samples_only_survivors(device):
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]], device=device).repeat(2000, 1)
    tokens = sample(logits, [SamplingParams(min_p=0.3)] * 2000, device).sampled_token_ids
    # p = softmax: token 4 has 0.35 x the top probability, tokens 2 and 3 less than 0.3.
    assert set(tokens.tolist()) == {0, 1, 4}


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproducible_and_batch_independent(device):
    vocab, steps = 64, 6
    step_logits = [random_logits(1, vocab, device, seed=10 + s)[0] * 0.3 for s in range(steps)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(batch_size, row):
        torch.manual_seed(batch_size)  # the unseeded rows differ between runs
        gen = make_request_generator(1234, device)
        other_gen = make_request_generator(99, device)
        tokens = []
        for s in range(steps):
            logits = random_logits(batch_size, vocab, device, seed=100 + s)
            logits[row] = step_logits[s]
            params = [SamplingParams(temperature=1.0)] * batch_size
            params[row] = seeded
            gens = {row: gen}
            if batch_size > 2:
                other = (row + 1) % batch_size
                params[other] = SamplingParams(temperature=0.7, seed=99)
                gens[other] = other_gen
            tokens.append(sample(logits, params, device, generators=gens).sampled_token_ids[row])
        return [int(t) for t in tokens]

    alone = run(1, 0)
    assert run(1, 0) == alone
    assert run(5, 3) == alone
    assert run(9, 0) == alone
    # A different seed gives a different stream (fixed seeds: deterministic check).
    gen = make_request_generator(4321, device)
    flat = torch.zeros(1, 1000, device=device)
    a = [int(sample(flat, [SamplingParams(seed=1234)], device,
                    generators={0: make_request_generator(1234, device)}).sampled_token_ids)]
    b = [int(sample(flat, [SamplingParams(seed=4321)], device,
                    generators={0: gen}).sampled_token_ids)]
    assert a != b


def reference_penalties(logits, prompts, outputs, params):
    out = logits.clone()
    for r, p in enumerate(params):
        for t in range(out.shape[1]):
            x = out[r, t].item()
            if t in prompts[r] or t in outputs[r]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[r].count(t)
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (count > 0)
            out[r, t] = x
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference(device):
    vocab = 12
    logits = random_logits(4, vocab, device, seed=3)
    prompts = [[1, 2, 2, 5], [0], [3, 4], [11, 7, 7]]
    outputs = [[2, 2, 9], [], [4, 4, 4, 10], [0, 11]]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=0.7, presence_penalty=-0.5,
                       frequency_penalty=1.5),
        SamplingParams(temperature=0),
    ]
    md = metadata(params, device, prompts=prompts, outputs=outputs, vocab=vocab)
    assert md.prompt_token_ids.tolist()[1] == [0, vocab, vocab, vocab]  # padded with V
    got = Sampler.apply_logits_processors(logits.clone(), md)
    want = reference_penalties(logits.cpu(), prompts, outputs, params)
    torch.testing.assert_close(got.cpu(), want)
    assert not torch.allclose(got.cpu(), logits.cpu())
    out = Sampler()(logits.clone(), md).sampled_token_ids
    assert torch.equal(out.cpu(), want.argmax(-1))  # greedy sees the penalised logits


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_with_ranks(device):
    torch.manual_seed(0)
    logits = random_logits(5, 30, device, seed=4)
    params = [SamplingParams(temperature=0.5, logprobs=3, presence_penalty=2.0)] * 4
    params.append(SamplingParams(temperature=0, logprobs=1))
    out = sample(logits, params, device, outputs=[[1, 2]] * 5)
    lt = out.logprobs_tensors
    assert lt.logprob_token_ids.shape == (5, 4) and lt.logprobs.shape == (5, 4)
    raw = logits.float().log_softmax(-1)  # before penalties and temperature
    sampled = out.sampled_token_ids
    assert torch.equal(lt.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(lt.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(3, dim=-1)
    assert torch.equal(lt.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lt.logprobs[:, 1:], top.values)
    ranks = [(raw[r] >= raw[r, sampled[r]]).sum().item() for r in range(5)]
    assert lt.selected_token_ranks.tolist() == ranks
    lists = lt.tolists()
    assert lists.logprob_token_ids[2][0] == int(sampled[2]) and lists.ranks == ranks
    assert math.isclose(lists.logprobs[2][1], top.values[2, 0].item(), rel_tol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_logprobs_gives_only_the_sampled_token(device):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], device=device)
    lt = sample(logits, [SamplingParams(temperature=0, logprobs=0)], device).logprobs_tensors
    assert lt.logprob_token_ids.tolist() == [[1]] and lt.selected_token_ranks.tolist() == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs(device):
    logits = random_logits(7, 20, device, seed=5)
    targets = torch.tensor([3, 0, 19, 5, 5, 7, 1], device=device)
    lt = compute_token_logprobs(logits.to(torch.bfloat16).float(), targets, num_logprobs=2)
    raw = logits.to(torch.bfloat16).float().log_softmax(-1)
    torch.testing.assert_close(lt.logprobs[:, 0], raw[torch.arange(7, device=device), targets])
    assert torch.equal(lt.logprob_token_ids[:, 0], targets)
    assert torch.equal(lt.logprob_token_ids[:, 1:], raw.topk(2, -1).indices)
    want_ranks = (raw >= raw[torch.arange(7, device=device), targets][:, None]).sum(-1)
    assert torch.equal(lt.selected_token_ranks, want_ranks)
    with pytest.raises(ValueError, match="num_logprobs must be in"):
        gather_logprobs(raw, 21, targets)


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_distribution(device):
    torch.manual_seed(1234)
    rows = 20000
    base = torch.tensor([1.0, 0.0, -0.5, 0.5], device=device)
    for temperature in (0.5, 1.0, 2.0):
        logits = base.repeat(rows, 1)
        tokens = sample(logits, [SamplingParams(temperature=temperature)] * rows, device)
        freq = torch.bincount(tokens.sampled_token_ids, minlength=4).float().cpu() / rows
        want = (base / temperature).softmax(-1).cpu()
        # 4 sigma of a binomial proportion at n=20000 is at most 0.0142.
        torch.testing.assert_close(freq, want, atol=0.0142, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_stop_tokens(device):
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 2, device=device)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    params.update_from_generation_config({}, model_eos_token_id=1)
    out = sample(logits, [params, params], device, outputs=[[2], [2, 2]])
    assert out.sampled_token_ids.tolist() == [2, 1]  # EOS (1) masked until 2 tokens exist


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias(device):
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]], device=device)
    p = SamplingParams(temperature=0, logit_bias={3: 10.0, 1: -100.0})
    assert sample(logits, [p], device).sampled_token_ids.tolist() == [3]
    with pytest.raises(ValueError, match="logit_bias token id 7 is outside"):
        metadata([SamplingParams(logit_bias={7: 1.0})], device, vocab=4)


def test_metadata_skips_unused_features():
    md = metadata([SamplingParams(temperature=0, top_k=3)] * 2, "cpu", vocab=10)
    assert md.all_greedy and md.temperature is None and md.top_k is None
    assert md.no_penalties and md.prompt_token_ids is None and md.max_num_logprobs is None
    md = metadata([SamplingParams(top_k=3, logprobs=2), SamplingParams(top_k=50)], "cpu", vocab=10)
    assert md.all_random and md.top_k.tolist() == [3, 10] and md.top_p is None
    assert md.max_num_logprobs == 2


def test_bad_inputs_rejected():
    md = metadata([SamplingParams()] * 2, "cpu", vocab=5)
    with pytest.raises(ValueError, match=r"N = 2 rows .* got \(3, 5\)"):
        Sampler()(torch.zeros(3, 5), md)
    with pytest.raises(ValueError, match="generators has rows \\[4\\]"):
        metadata([SamplingParams()], "cpu", vocab=5, generators={4: torch.Generator()})
