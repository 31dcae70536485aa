"""The runner's all-decode fast path in `_prepare_inputs` equals its general path.

A decode step (one token per row) skips the per-token bookkeeping (the list of
scheduled counts, cumsum, token rows) and, when every row samples, leaves the
logits indices unwritten (the sampler reads `hidden[:n]`, no gather). On a
real CPU engine (tiny random-weight Llama) every step of a run that mixes a
long decode with requests arriving, prefilling in chunks and finishing is
prepared twice: by the general path (the fast-path test forced off) and by the
real call, and the two must agree on every field and buffer the step reads.
Each step's `no_cached_context` flag must say whether every request's keys are
its own new tokens (seq_lens equal to the query lengths).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model_dirs import llama_config, make_model_dir


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM

    model_dir = make_model_dir(tmp_path_factory.mktemp("tiny"), llama_config(), weights=False)
    llm = LLM(str(model_dir), load_format="dummy", dtype="float32", max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=64)
    yield llm
    llm.llm_engine.shutdown()


def _snapshot(runner, result) -> dict:
    metadata, num_sched, rows = result
    end = metadata.num_actual_tokens
    n = metadata.query_start_loc.shape[0] - 1
    return {
        "num_sched": num_sched.copy(),
        "rows": rows.copy(),
        "max_query_len": metadata.max_query_len,
        "max_seq_len": metadata.max_seq_len,
        "no_cached_context": metadata.no_cached_context,
        "input_ids": runner.buffers.input_ids[:end].clone(),
        "positions": runner.buffers.positions[:end].clone(),
        "slot_mapping": metadata.slot_mapping.clone(),
        "query_start_loc": metadata.query_start_loc.clone(),
        "seq_lens": metadata.seq_lens.clone(),
        "block_table": metadata.block_table[:n].clone(),
        "logits_indices": runner.buffers.logits_indices[: len(rows)].clone(),
    }


def test_decode_fast_path_prepares_what_the_general_path_does(llm, monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = llm.llm_engine.engine_core.worker.model_runner
    assert type(runner) is GPUModelRunner  # the class patched below is the one stepping
    original = GPUModelRunner._prepare_inputs
    seen = {"fast": 0, "general": 0, "fresh": 0, "not fresh": 0}

    def checked(self, so):
        fast = self._all_single_token(so, self.input_batch.num_reqs)
        with monkeypatch.context() as m:
            m.setattr(GPUModelRunner, "_all_single_token", staticmethod(lambda so, n: False))
            reference = _snapshot(self, original(self, so))
        got = _snapshot(self, original(self, so))
        for key, want in reference.items():
            value = got[key]
            equal = (torch.equal(value, want) if isinstance(value, torch.Tensor)
                     else np.array_equal(value, want) if isinstance(value, np.ndarray)
                     else value == want)
            assert equal, (key, value, want)
        # The fresh-prefill flag: every request's keys are this step's tokens.
        lens = got["seq_lens"].cpu()
        fresh = bool(torch.equal(lens, got["query_start_loc"].cpu().diff().to(lens.dtype)))
        assert got["no_cached_context"] is fresh, (got["no_cached_context"], lens)
        seen["fresh" if fresh else "not fresh"] += 1
        seen["fast" if fast else "general"] += 1
        return original(self, so)

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", checked)
    engine = llm.llm_engine
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": list(range(3, 20))}, long)
    for step in range(60):
        if step in (5, 12):  # arrivals: a chunked prefill (> 64 tokens) beside the decodes
            engine.add_request(f"late-{step}", {"prompt_token_ids": list(range(3, 90))}, short)
        if step == 8:
            engine.add_request("one-token", {"prompt_token_ids": [7]}, short)
        engine.step()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert seen["fast"] >= 20 and seen["general"] >= 3, seen
    assert seen["fresh"] >= 1 and seen["not fresh"] >= 20, seen
