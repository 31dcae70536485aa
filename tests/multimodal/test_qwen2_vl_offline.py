"""Qwen2-VL offline (CPU, fp32): greedy tokens equal transformers' for 0, 1 and 2 images of
different sizes, through `generate` and `chat`, with chunked prefill cutting through an image,
and with prefix caching telling two images apart; bad image inputs are refused."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.multimodal.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, image
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Three images of different sizes: 4, 6 and 16 placeholder tokens.
IMAGES = {"small": image(50, 50, 1), "wide": image(90, 50, 2), "large": image(120, 110, 3)}
PROMPTS = {
    0: ("Hello world, this is text only.", []),
    1: (f"Hello {IMAGE_PLACEHOLDER} what is it?", ["wide"]),
    2: (f"A {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER} compared.", ["large", "small"]),
}


@pytest.fixture(scope="module")
def vl_llm(qwen2_vl_dir):
    from vllm import LLM

    llm = LLM(str(qwen2_vl_dir), dtype="float32", max_model_len=256, max_num_seqs=8)
    yield llm
    llm.llm_engine.shutdown()


def _mm(names: list[str]) -> dict:
    images = [IMAGES[n] for n in names]
    return {"image": images[0] if len(images) == 1 else images}


def _expected(llm, reference, text: str, names: list[str]) -> list[int]:
    ids = llm.get_tokenizer().encode(text)
    return reference(ids, [IMAGES[n] for n in names], MAX_TOKENS)


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_generate_matches_transformers(vl_llm, qwen2_vl_reference, num_images):
    text, names = PROMPTS[num_images]
    prompt = {"prompt": text, "multi_modal_data": _mm(names)} if names else text
    (out,) = vl_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == _expected(vl_llm, qwen2_vl_reference, text, names)
    # The placeholders were expanded: one token per encoder output row.
    expected_pads = {0: 0, 1: 6, 2: 16 + 4}[num_images]
    assert out.prompt_token_ids.count(vl_llm.llm_engine.processor.mm_processor.image_token_id
                                       if names else -1) == expected_pads


def test_batch_of_mixed_prompts_matches(vl_llm, qwen2_vl_reference):
    prompts = [{"prompt": t, "multi_modal_data": _mm(n)} if n else t for t, n in PROMPTS.values()]
    outs = vl_llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, (text, names) in zip(outs, PROMPTS.values(), strict=True):
        assert list(out.outputs[0].token_ids) == _expected(vl_llm, qwen2_vl_reference, text,
                                                           names)


def test_prefix_cache_tells_images_apart(vl_llm, qwen2_vl_reference):
    """Same text and image size, different pixels: the placeholder ids are equal, so only
    the image's hash in the block hashes keeps the second from reusing the first's KV."""
    text = f"Describe {IMAGE_PLACEHOLDER} in detail please, thank you very much."
    other = image(90, 50, 99)
    first, second = (vl_llm.generate({"prompt": text, "multi_modal_data": {"image": img}},
                                     GREEDY, use_tqdm=False)[0] for img in (IMAGES["wide"], other))
    ids = vl_llm.get_tokenizer().encode(text)
    assert list(second.outputs[0].token_ids) == qwen2_vl_reference(ids, [other], MAX_TOKENS)
    assert list(first.outputs[0].token_ids) == qwen2_vl_reference(ids, [IMAGES["wide"]],
                                                                  MAX_TOKENS)
    # The same image again is served from the prefix cache and still matches.
    again = vl_llm.generate({"prompt": text, "multi_modal_data": {"image": other}}, GREEDY,
                            use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert list(again.outputs[0].token_ids) == list(second.outputs[0].token_ids)


def _transparent_image():
    """RGBA, its left half fully transparent over random colours (what PNG logos carry)."""
    from PIL import Image

    pixels = np.random.default_rng(5).integers(0, 256, (84, 84, 4), dtype=np.uint8)
    pixels[:, :42, 3] = 0
    pixels[:, 42:, 3] = 255
    return Image.fromarray(pixels, "RGBA")


def test_a_transparent_image_matches_transformers(vl_llm, qwen2_vl_reference):
    """transformers composites transparency onto white (as vLLM does): offline and through
    a chat data: URL, the tokens equal its generate on the same RGBA image (the alpha was
    dropped, leaving the colours under it, and the tokens differed)."""
    rgba = _transparent_image()
    text = f"Look {IMAGE_PLACEHOLDER} here."
    want = qwen2_vl_reference(vl_llm.get_tokenizer().encode(text), [rgba], MAX_TOKENS)
    (out,) = vl_llm.generate({"prompt": text, "multi_modal_data": {"image": rgba}}, GREEDY,
                             use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    (chat,) = vl_llm.chat(messages, GREEDY, use_tqdm=False)
    ids = vl_llm.get_tokenizer().encode(vl_llm.render_chat(messages)["prompt"],
                                        add_special_tokens=False)
    assert list(chat.outputs[0].token_ids) == qwen2_vl_reference(ids, [rgba], MAX_TOKENS)


def test_a_file_url_offline_names_the_llm_argument(vl_llm):
    """Offline, a file:// image without allowed_local_media_path: the error says which
    argument of LLM allows it (it named only the server's flag)."""
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///tmp/cat.png"}}]}]
    with pytest.raises(VLLMValidationError, match=r"LLM\(\.\.\., allowed_local_media_path"):
        vl_llm.chat(messages, GREEDY, use_tqdm=False)


def test_chat_with_image_parts(vl_llm, qwen2_vl_reference):
    buf = io.BytesIO()
    IMAGES["wide"].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " and "},
        {"type": "image_pil", "image_pil": IMAGES["small"]},
    ]}]
    (out,) = vl_llm.chat(messages, GREEDY, use_tqdm=False)
    text = vl_llm.render_chat(messages)["prompt"]
    assert text.count(IMAGE_PLACEHOLDER) == 2
    ids = vl_llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert list(out.outputs[0].token_ids) == qwen2_vl_reference(
        ids, [IMAGES["wide"], IMAGES["small"]], MAX_TOKENS)


def test_chunked_prefill_through_an_image(qwen2_vl_dir, qwen2_vl_reference):
    """8 tokens a step: the 16-token image is cut across three steps (its encoder output
    is computed once, kept in the encoder cache, read by each chunk)."""
    from vllm import LLM

    llm = LLM(str(qwen2_vl_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=8)
    try:
        for text, names in PROMPTS.values():
            prompt = {"prompt": text, "multi_modal_data": _mm(names)} if names else text
            (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
            assert list(out.outputs[0].token_ids) == _expected(llm, qwen2_vl_reference, text,
                                                               names)
        stats = llm.llm_engine.get_scheduler_stats()
        assert stats.num_preemptions == 0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("mm_data, message", [
    ({"image": "not an image"}, "must be a PIL image"),
    ({"video": image(50, 50, 0)}, "modality 'video' is not supported"),
    ({"image": [image(50, 50, 0)] * 2}, "1 image placeholder token(s)"),
    # A 0 x N image reached the image processor and raised ZeroDivisionError.
    ({"image": image(0, 0, 0)}, "the image has no pixels (0x0)"),
    ({"image": image(40, 0, 0)}, "the image has no pixels (40x0)"),
])
def test_bad_multi_modal_data_is_refused(vl_llm, mm_data, message):
    with pytest.raises(VLLMValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        vl_llm.generate({"prompt": f"x {IMAGE_PLACEHOLDER}", "multi_modal_data": mm_data},
                        GREEDY, use_tqdm=False)
    # The engine still serves.
    assert vl_llm.generate("still here", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_text_only_model_refuses_images(bundled_llm):
    with pytest.raises(VLLMValidationError, match="text-only") as info:
        bundled_llm.generate({"prompt": "hi", "multi_modal_data": {"image": image(50, 50, 0)}},
                             GREEDY, use_tqdm=False)
    assert info.value.parameter == "multi_modal_data"


def test_spec_decode_with_a_multimodal_model_is_refused(qwen2_vl_dir):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(qwen2_vl_dir), dtype="float32", max_model_len=256,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config is not supported with a multi"):
        args.create_engine_config()


def test_image_flags_on_a_multimodal_model_give_no_warning(qwen2_vl_dir, caplog):
    """The warning that image flags have no effect is for text-only models only."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    with caplog.at_level(logging.WARNING, logger="vllm"):
        cfg = EngineArgs(model=str(qwen2_vl_dir), dtype="float32", max_model_len=256,
                         limit_mm_per_prompt={"image": 2}).create_engine_config()
    assert cfg.multimodal_config.limit_mm_per_prompt == {"image": 2}
    assert not [r for r in caplog.records if "no effect" in r.getMessage()], caplog.text


def test_preempted_requests_with_images_match(qwen2_vl_dir, qwen2_vl_reference):
    """A KV cache of a few blocks: requests with images are preempted and recomputed (their
    images encoded again or taken from the encoder cache); greedy tokens do not change."""
    from vllm import LLM

    llm = LLM(str(qwen2_vl_dir), dtype="float32", max_model_len=128, max_num_seqs=8,
              kv_cache_memory_bytes=14 * 8192)  # 14 blocks of 16 tokens (2 layers, fp32)
    try:
        cases = [PROMPTS[2], PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
        prompts = [{"prompt": t, "multi_modal_data": _mm(n)} if n else t for t, n in cases]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.get_scheduler_stats().num_preemptions > 0
        for out, (text, names) in zip(outs, cases, strict=True):
            ids = llm.get_tokenizer().encode(text)
            assert list(out.outputs[0].token_ids) == qwen2_vl_reference(
                ids, [IMAGES[n] for n in names], 24)
    finally:
        llm.llm_engine.shutdown()


def test_start_up_plan_names_the_encoder_budget(vl_llm):
    """Default budget: max(max_num_batched_tokens = 512 on the CPU, one worst-case image of
    16 tokens); the cache [512, hidden 64] fp32 is held and named."""
    plan = vl_llm.llm_engine.engine_core.plan
    assert (plan.encoder_budget, plan.encoder_cache_size) == (512, 512)
    assert plan.encoder_cache_bytes == 512 * 64 * 4
    assert "encoder_budget=512 tokens, encoder_cache=512 tokens (0.00 GiB)" in plan.describe()
