"""Fixtures the end-to-end tests share."""

from __future__ import annotations

import pytest

from tests.model_dirs import llama_config, make_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint (config + safetensors), one per test module
    (a module may write into it, e.g. a generation_config.json)."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"), llama_config(), weights=True)
