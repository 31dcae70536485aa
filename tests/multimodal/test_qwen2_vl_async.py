"""Qwen2-VL through AsyncLLM (the server's engine client)."""

from __future__ import annotations

import asyncio

import pytest

from tests.multimodal.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, image
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_engine(qwen2_vl_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(qwen2_vl_dir), dtype="float32", max_model_len=256, max_num_seqs=8,
        kv_cache_memory_bytes=64 * 2**20, disable_log_stats=True))
    yield engine
    engine.shutdown()


async def _last(engine: AsyncLLM, request_id: str, prompt) -> object:
    return [out async for out in engine.generate(prompt, PARAMS, request_id)][-1]


def test_a_text_prompt_keeps_its_images(vl_engine):
    """{"prompt": text, "multi_modal_data": ...}: tokenizing the text kept the images
    (they were dropped, and the request ran as text with one placeholder token)."""
    prompt = {"prompt": f"{IMAGE_PLACEHOLDER} what?",
              "multi_modal_data": {"image": image(50, 50, 1)}}
    out = asyncio.run(_last(vl_engine, "text-and-image", prompt))
    image_token_id = vl_engine.processor.mm_processor.image_token_id
    assert out.prompt_token_ids.count(image_token_id) == 4  # 56 x 56 pixels: 2 x 2 tokens
