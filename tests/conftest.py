"""Shared test setup: the `cuda` marker skips cleanly where no NVIDIA GPU is present."""

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
