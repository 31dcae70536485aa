"""The loader interface, and building a model directly on its device and dtype."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class BaseModelLoader(ABC):
    """Fills a constructed model's parameters from one source (files or random)."""

    def validate(self, model_path: str) -> None:  # noqa: B027 (optional hook)
        """Check the source exists before the model is built; raise FileNotFoundError if not."""

    @abstractmethod
    def load_weights(self, model: nn.Module, model_path: str) -> set[str]:
        """Load every parameter of `model`; returns the parameter names loaded.

        Raises:
            FileNotFoundError: a file is missing (named).
            ValueError: unexpected/missing tensors, unsupported types or shape
                mismatches, naming the file and tensor.
        """


@contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, new floating tensors default to `dtype`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
