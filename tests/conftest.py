"""Shared test setup: the `cuda` marker skips cleanly where no NVIDIA GPU is present, and
one offline engine on the bundled model for every module that only reads from it."""

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.version.hip is None


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (CUDA); skipped without one")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bundled_llm():
    """The offline `LLM` on the bundled model (the server tests' context length and budget).

    Shared by the whole session: starting an engine is the slowest thing a test can do
    on the CPU. Tests that use it only generate (and read counters as differences);
    anything that changes an engine's state (sleep, another config) builds its own.
    """
    from tests.entrypoints.openai.utils import ENGINE_KWARGS
    from vllm import LLM

    llm = LLM(**ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()
