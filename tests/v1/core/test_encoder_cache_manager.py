"""EncoderCacheManager: per-step encoder budget, cache space, chunk cuts, reuse, eviction."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager


def _request(req_id: str, *images: tuple[str, int, int]):
    """images: (mm_hash, offset, length)."""
    features = [MultiModalFeatureSpec("image", h, PlaceholderRange(o, n), {})
                for h, o, n in images]
    return SimpleNamespace(request_id=req_id, mm_features=features)


def test_chunk_stops_before_an_image_over_the_step_budget():
    enc = EncoderCacheManager(cache_size=100, max_num_encoder_input_tokens=10)
    req = _request("a", ("x", 2, 8), ("y", 12, 8))
    # x fits the budget (8 of 10); y does not (8 more): the chunk stops at y's offset.
    assert enc.fit(req, 0, 30) == 12
    assert enc.step_output() == ({"a": [0]}, [])
    # Next step: x is cached, y is encoded.
    assert enc.fit(req, 12, 18) == 18
    assert enc.step_output() == ({"a": [1]}, [])
    assert enc.num_cached_tokens == 16


def test_done_images_become_freeable_and_are_evicted_oldest_first():
    enc = EncoderCacheManager(cache_size=10, max_num_encoder_input_tokens=10)
    a, b = _request("a", ("x", 0, 6)), _request("b", ("y", 0, 6))
    assert enc.fit(a, 0, 6) == 6
    enc.step_output()
    assert enc.fit(b, 0, 6) == 0  # x is still needed by a: no room for y
    assert enc.fit(a, 6, 1) == 1  # a's placeholders are computed: x is let go
    assert list(enc.freeable) == ["x"]
    assert enc.fit(b, 0, 6) == 6  # x evicted for y, and the runner is told
    assert enc.step_output() == ({"b": [0]}, ["x"])


def test_same_image_in_two_requests_is_encoded_once():
    enc = EncoderCacheManager(cache_size=20, max_num_encoder_input_tokens=20)
    a, b = _request("a", ("x", 1, 5)), _request("b", ("x", 3, 5))
    assert enc.fit(a, 0, 10) == 10
    assert enc.fit(b, 0, 10) == 10
    assert enc.step_output() == ({"a": [0]}, [])
    assert enc.refs["x"] == {"a", "b"} and enc.num_cached_tokens == 5


def test_free_undoes_this_steps_encode_and_budget():
    enc = EncoderCacheManager(cache_size=20, max_num_encoder_input_tokens=8)
    a = _request("a", ("x", 0, 8))
    assert enc.fit(a, 0, 8) == 8
    enc.free(a)  # e.g. its KV blocks did not fit after all
    assert enc.num_cached_tokens == 0 and "x" not in enc.cached
    assert enc.step_output() == ({}, [])
    assert enc.fit(_request("b", ("y", 0, 8)), 0, 8) == 8  # the budget came back


def test_text_requests_pass_untouched():
    enc = EncoderCacheManager(0, 0)
    assert enc.fit(_request("t"), 0, 123) == 123
    assert enc.step_output() == ({}, [])
