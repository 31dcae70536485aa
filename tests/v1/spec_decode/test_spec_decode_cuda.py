"""Speculative decoding on CUDA: verify batches replay their own CUDA graphs, greedy output
equal to decoding without speculation (fp32 tiny Llama, random weights)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.model_dirs import llama_config, make_model_dir
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [[0] + [5, 6, 7, 8, 9, 10] * 6, [0] + list(range(20, 60)) * 2, [0, 3, 4, 3, 4, 3]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def test_verify_graphs_and_greedy_equal(tmp_path):
    model_dir = make_model_dir(tmp_path / "tiny", llama_config(), weights=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs, runners = [], []
    for spec in (None, NGRAM):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                  gpu_memory_utilization=0.3, speculative_config=spec)
        runner = llm.llm_engine.engine_core.worker.model_runner
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        verify = runner.verify_rows  # None without speculative decoding
        graphs = (verify.graphs.capture_sizes, verify.graphs.num_replays) if verify else ([], 0)
        runners.append((*graphs, llm.llm_engine.get_scheduler_stats().spec_decoding_stats))
        llm.llm_engine.shutdown()
        del llm, runner, verify
        gc.collect()
        torch.cuda.empty_cache()
    sizes, replays, stats = runners[1]
    assert sizes == [1, 2, 4, 8] and replays > 0
    assert stats.num_drafts > 0
    # fp32, but a verify batch reduces in another order than one-token decode:
    # allow one prompt to differ at an exact near-tie.
    exact = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert exact >= len(PROMPTS) - 1


def test_spec_decode_seeded_sampling_reproducible_cuda(tmp_path):
    model_dir = make_model_dir(tmp_path / "tiny", llama_config(), weights=True)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
              gpu_memory_utilization=0.3, speculative_config=NGRAM)
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=11, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == second
    llm.llm_engine.shutdown()


def test_draft_model_self_draft_cuda(tmp_path):
    """The tiny model as its own draft: drafts (nearly) all accepted, greedy output equal."""
    model_dir = make_model_dir(tmp_path / "tiny", llama_config(), weights=True)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = []
    for spec in (None, {"method": "draft_model", "model": str(model_dir),
                        "num_speculative_tokens": 3}):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                  gpu_memory_utilization=0.3, speculative_config=spec)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)])
        if spec:
            stats = llm.llm_engine.get_scheduler_stats().spec_decoding_stats
            assert stats.num_drafts > 0 and stats.acceptance_rate > 0.9
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    exact = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert exact >= len(PROMPTS) - 1


def test_verification_and_device_ngram_without_host_sync():
    """The verification's device result and the device n-gram proposal launch no
    synchronising call (torch.cuda.set_sync_debug_mode("error") raises on one), and
    the proposal equals the numpy `NgramProposer`'s."""
    from vllm.v1.sample.metadata import build_sampling_metadata, make_request_generator
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    from vllm.v1.worker.ngram_device import DeviceNgramProposer

    dev = torch.device("cuda")
    vocab = 64
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.0, top_k=8)]
    drafts = [[1, 2, 3, 4], [5, 6], []]
    rows = [p for p, d in zip(params, drafts, strict=True) for _ in range(len(d) + 1)]
    md = build_sampling_metadata(rows, [[0]] * len(rows), [[] for _ in rows], {}, vocab, dev)
    logits = torch.randn(len(rows), vocab, device=dev)
    gens = {1: make_request_generator(5, dev)}
    history = torch.randint(0, 4, (8, 100), device=dev)
    num_tokens = torch.randint(1, 101, (8,), device=dev)
    proposer = DeviceNgramProposer(4, 2, 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        emitted = RejectionSampler().emitted_on_device(drafts, logits, md, gens)
        got, counts = proposer.propose(history, num_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert emitted.shape == (3, 5)
    target = logits.argmax(dim=-1).tolist()[:5]  # the greedy row: the host rule
    accepted = 0
    while accepted < 4 and drafts[0][accepted] == target[accepted]:
        accepted += 1
    assert emitted[0].tolist() == target[: accepted + 1] + [-1] * (4 - accepted)
    assert (emitted[1, 3:] == -1).all() and (emitted[2, 1:] == -1).all()
    ref = NgramProposer(4, 2, 5)
    for b in range(8):
        n = int(num_tokens[b])
        assert got[b, : int(counts[b])].tolist() == ref.propose(history[b, :n].cpu().numpy())


def test_async_spec_decode_equal_to_sync_and_no_host_sync_in_a_step(tmp_path):
    """Async scheduling with ngram drafts on the GPU (opt-in until this passes): the same fp32
    greedy tokens as the synchronous spec path; verify graphs replay; a decode step of
    device rows launches no synchronising call (set_sync_debug_mode("error"))."""
    model_dir = make_model_dir(tmp_path / "tiny", llama_config(), weights=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs, checked = [], []
    for asynchronous in (False, True):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                  gpu_memory_utilization=0.3, speculative_config=NGRAM,
                  async_scheduling=asynchronous)
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is asynchronous
        runner = llm.llm_engine.engine_core.worker.model_runner
        execute = runner.execute_model

        def checked_execute(so, execute=execute, runner=runner):
            decode_only = not so.scheduled_new_reqs and set(so.num_scheduled_tokens) == set(
                so.scheduled_spec_decode_tokens)
            if runner.async_spec is None or not decode_only:
                return execute(so)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = execute(so)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            checked.append(so.total_num_scheduled_tokens)
            return out

        runner.execute_model = checked_execute
        outs.append([o.outputs[0].token_ids
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        stats = llm.llm_engine.get_scheduler_stats().spec_decoding_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
        assert runner.verify_rows.graphs.num_replays > 0  # every mode replays verify graphs
        if asynchronous:  # the device rows' Triton kernels (async_spec_ops.py), not torch ops
            assert runner.async_spec.ops is not None
        llm.llm_engine.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    # fp32; the two paths batch the verify rows differently (GEMM shapes): as above, allow
    # one prompt to differ at an exact near-tie.
    exact = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert exact >= len(PROMPTS) - 1
    assert checked, "no decode step of device rows ran under the sync check"
