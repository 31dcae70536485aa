"""The profile and warmup batches stay within what the scheduler can make.

Found on the H200: with max_num_seqs x max_model_len below max_num_batched_tokens
(8 x 512 < 8192), the worst-case dummy batch gave each request 1024 tokens, whose
keys indexed past a 32-entry block-table row: an illegal address at start-up.
"""

from __future__ import annotations

import logging

import pytest

from tests.model_dirs import llama_config, make_model_dir
from vllm import LLM, SamplingParams


def test_dummy_batches_fit_max_model_len(tmp_path, caplog):
    model_dir = make_model_dir(tmp_path / "tiny", llama_config(), weights=True)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=32, max_num_seqs=2,
                  max_num_batched_tokens=512, kv_cache_memory_bytes=8 << 20)
    try:
        # 2 requests x 32 tokens, not 512 tokens.
        assert "a worst-case forward of 64 tokens" in caplog.text
        assert "a worst-case prefill of 64 tokens" in caplog.text
        runner = llm.llm_engine.engine_core.worker.model_runner
        with pytest.raises(ValueError, match="exceed max_model_len=32 per request"):
            runner.warmup.dummy_run(512, 2, with_kv=True)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": [0, 5, 6, 7]}] * 2, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("max_model_len", "num_tokens", "num_reqs", "expected"),
    [
        (2048, 8192, 256, [(8192, 4)]),  # 32-token prompts; 4 x 2048 take the fresh kernel
        (3000, 8192, 256, [(8192, 3)]),  # ceil(8192 / 3000) prompts of <= 3000 tokens
        (2048, 8192, 8, []),  # the worst case's own prompts are already >= 128 tokens
        (100, 8192, 256, []),  # no prompt reaches 128 tokens
    ],
)
def test_warmup_adds_long_fresh_prompts_where_the_worst_case_has_none(
    max_model_len, num_tokens, num_reqs, expected
):
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_worker import Worker

    calls = []
    warmup = SimpleNamespace(
        dummy_run=lambda tokens, reqs, with_kv: calls.append((tokens, reqs)),
    )
    runner = SimpleNamespace(max_model_len=max_model_len, warmup=warmup)
    worker = object.__new__(Worker)
    worker.model_runner = runner
    worker._warm_up_long_prompts(num_tokens, num_reqs)
    assert calls == expected
