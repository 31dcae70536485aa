"""Random weights for benchmarks: only config.json is needed, no checkpoint.

Every parameter is drawn uniformly from [-1e-3, 1e-3] with a fixed seed, on
the parameter's device (a Llama-3-8B fills in well under a second on a GPU).
Small values keep activations finite through any depth; the outputs are
meaningless, the shapes and the work are real.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.model_loader.base_loader import BaseModelLoader

DUMMY_SEED = 0
DUMMY_RANGE = 1e-3


class DummyModelLoader(BaseModelLoader):
    """load_format "dummy"."""

    def __init__(self, seed: int = DUMMY_SEED) -> None:
        self.seed = seed

    def load_weights(self, model: nn.Module, model_path: str) -> set[str]:
        generators: dict[torch.device, torch.Generator] = {}
        names = set()
        with torch.no_grad():
            for name, param in model.named_parameters():
                generator = generators.get(param.device)
                if generator is None:
                    generator = torch.Generator(device=param.device).manual_seed(self.seed)
                    generators[param.device] = generator
                param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
                names.add(name)
        return names
