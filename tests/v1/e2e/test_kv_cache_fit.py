"""The KV cache honours its size and its use, and max_model_len fits the cache (issue #16):
as in vLLM, a cache too small for one request of max_model_len fails the start-up, and
only max_model_len auto (-1) is fitted to the cache.

The bundled model (SmolLM2-135M, fp32 on the CPU): 30 layers, one segment each,
blocks of 16 tokens x 2 x 3 KV heads x 64 x 4 bytes = 24 KiB per layer (720 KiB a
block over the 30 layers); host granules of 2 MiB hold 85 blocks per segment.
"""

from __future__ import annotations

import gc

import httpx
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from vllm import LLM, SamplingParams

MiB = 1 << 20


SMALL = dict(max_num_seqs=2, max_num_batched_tokens=256, kv_cache_memory_bytes=64 * MiB,
             enable_extensible_kv_cache=True)


@pytest.fixture(scope="module")
def small_cache_llm():
    # 64 MiB asked: 67108864 / 737280 = 91 blocks, vLLM's count (issue 48: 85 before),
    # packed segments commit 64 MiB; (91 - 1) x 16 = 1440 tokens for one sequence, below
    # the model's 8192, which max_model_len auto (-1) lowers to that.
    engine = LLM(max_model_len=-1, **SMALL)
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


def test_explicit_size_within_one_granule_and_max_model_len_auto_fitted(small_cache_llm):
    worker = small_cache_llm.llm_engine.engine_core.worker
    assert worker.kv_cache.committed_blocks == worker.kv_cache.capacity_blocks == 91
    # Within one granule in total (aligned segments would commit 120 MiB for 91 blocks).
    assert worker.kv_cache.committed_bytes == 64 * MiB
    # The fitted length is the plan's; the configuration keeps the model's.
    assert small_cache_llm.llm_engine.max_model_len == 1440
    assert small_cache_llm.llm_engine.engine_core.plan.max_model_len == 1440
    assert small_cache_llm.llm_engine.vllm_config.model_config.max_model_len == 8192
    # A request up to the fitted length is served; one past it is refused up front.
    prompt = {"prompt_token_ids": [28] * 1340}  # prefill in six steps, then four tokens
    out = small_cache_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                            ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="prompt has 1440 tokens"):
        small_cache_llm.generate([{"prompt_token_ids": [28] * 1440}], SamplingParams(),
                                 use_tqdm=False)


@pytest.mark.parametrize(("max_model_len", "where"), [
    (2048, "--max-model-len"),
    (None, "the model's context length; --max-model-len was not given"),
])
def test_a_max_model_len_the_cache_cannot_hold_fails_the_start_up(max_model_len, where):
    """vLLM refuses to start rather than serve a shorter length (this engine lowered it with a
    warning): the error names the memory one request needs, what the cache has (90 usable
    blocks of 720 KiB) and the longest length that fits."""
    needed = -(-(max_model_len or 8192) // 16)
    with pytest.raises(ValueError) as e:
        LLM(max_model_len=max_model_len, **SMALL)
    gc.collect()
    assert str(e.value) == (
        f"max_model_len {max_model_len or 8192} ({where}) does not fit the KV cache: one "
        f"request of {max_model_len or 8192} tokens needs {needed} blocks of 16 tokens, "
        f"{needed * 737280 / 2**30:.2f} GiB ({needed * 737280} bytes) of KV cache, but the "
        "cache holds 90 usable blocks, 0.06 GiB (66355200 bytes); based on that memory the "
        "maximum model length is 1440. Raise --gpu-memory-utilization or "
        "--kv-cache-memory-bytes, lower --max-model-len to at most 1440, or pass "
        "--max-model-len auto to serve the longest length that fits")


def test_a_fixed_cache_reports_its_blocks_in_use_and_its_size_as_its_limit(small_cache_llm):
    """Without the elastic cache the in-use and limit figures (/metrics'
    vllm:kv_cache_in_use_bytes and vllm:kv_cache_limit_bytes) read 0, so in use <=
    committed <= limit did not hold: in use is the blocks requests hold, the limit the
    cache's own blocks (it cannot grow), both in blocks' bytes (720 KiB each)."""
    engine, block = small_cache_llm.llm_engine, 737280
    idle = engine.get_kv_cache_memory()
    assert idle.limit_bytes == idle.committed_bytes == 91 * block and idle.in_use_bytes == 0
    engine.add_request("in-use", {"prompt_token_ids": [29] * 100},
                       SamplingParams(max_tokens=4, ignore_eos=True))
    try:
        engine.step()  # the whole prompt in one step: ceil(100 / 16) = 7 blocks
        memory = engine.get_kv_cache_memory()
        assert memory.in_use_bytes == 7 * block
        assert memory.in_use_bytes <= memory.committed_bytes <= memory.limit_bytes
    finally:
        engine.abort_request(["in-use"])
    assert engine.get_kv_cache_memory().in_use_bytes == 0


def test_committed_kv_never_exceeds_what_the_engine_can_use():
    # max_num_seqs 1 x max_model_len 256 = 17 blocks of use: one granule per layer
    # (85 blocks, 60 MiB), not the CPU default budget of several GiB.
    engine = LLM(max_model_len=256, max_num_seqs=1, max_num_batched_tokens=256,
                 enable_extensible_kv_cache=True)
    try:
        kv_cache = engine.llm_engine.engine_core.worker.kv_cache
        assert kv_cache.committed_blocks == 85
        assert kv_cache.committed_bytes == 60 * MiB
        assert kv_cache.capacity_blocks == 256  # address space, granule aligned
    finally:
        engine.llm_engine.shutdown()
        gc.collect()


def test_server_advertises_the_auto_fitted_max_model_len():
    with RemoteServer(["--max-model-len", "auto", "--max-num-seqs", "2",
                       "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", "64MiB",
                       "--uvicorn-log-level", "warning", "--disable-log-stats"]) as server:
        assert "serving max_model_len 1440" in server.startup_log
        models = httpx.get(server.url_for("v1/models"), timeout=30).json()
        assert models["data"][0]["max_model_len"] == 1440
        # A plain chat request without max_tokens is served (not refused for 2048).
        reply = server.get_client().chat.completions.create(
            model=models["data"][0]["id"], messages=[{"role": "user", "content": "Hi"}],
            stop=[" ", "\n", "."])  # a few tokens: the point is that it is accepted
        assert reply.choices[0].message.content
