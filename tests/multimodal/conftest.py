"""One tiny random Qwen2-VL checkpoint per session, and transformers' model over it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    from tests.multimodal.qwen2_vl_checkpoint import make_qwen2_vl_dir

    return make_qwen2_vl_dir(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="session")
def qwen2_vl_reference(qwen2_vl_dir):
    """(prompt ids, images, max_tokens) -> transformers' greedy tokens, memoised."""
    from tests.multimodal.qwen2_vl_checkpoint import hf_generate

    memo: dict = {}

    def generate(prompt_ids: list[int], images: list, max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), tuple(id(i) for i in images), max_tokens)
        if key not in memo:
            memo[key] = hf_generate(qwen2_vl_dir, prompt_ids, images, max_tokens)
        return memo[key]

    return generate
