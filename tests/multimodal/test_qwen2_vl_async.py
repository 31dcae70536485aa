"""Qwen2-VL through AsyncLLM (the server's engine client): an image's preprocessing
(transformers' image processor, seconds for a large photo) never holds the event loop."""

from __future__ import annotations

import asyncio
import threading

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


def test_a_slow_image_preprocessing_holds_no_other_request(vl_engine, monkeypatch):
    """While one request's image is stuck in the image processor (held on an event,
    standing in for a 9000 x 9000 photo, 3 s on this CPU), a request already
    tokenized runs to the end. Before preprocessing left the event loop, the loop
    stood still until the image was done (an ordering check, not a time limit)."""
    mm = vl_engine.processor.mm_processor
    real = mm.image_processor
    slow_image = image(77, 77, 5)
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def processor(images, **kwargs):
        if images[0].size == slow_image.size:
            started.set()
            release.wait(30)
            order.append("image processed")
        return real(images=images, **kwargs)

    monkeypatch.setattr(mm, "image_processor", processor)

    async def main():
        slow = asyncio.ensure_future(_last(vl_engine, "slow", {
            "prompt": f"{IMAGE_PLACEHOLDER} what?", "multi_modal_data": {"image": slow_image}}))
        assert await asyncio.to_thread(started.wait, 60)
        try:
            small = await asyncio.wait_for(
                _last(vl_engine, "small", {"prompt_token_ids": [5, 6, 7]}), 60)
            order.append("small done")
        finally:
            release.set()
        return small, await slow

    small, slow = asyncio.run(main())
    assert order == ["small done", "image processed"]
    assert len(small.outputs[0].token_ids) == len(slow.outputs[0].token_ids) == 4
