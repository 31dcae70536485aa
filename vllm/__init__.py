"""vLLM with an extensible KV cache.

The public names are imported lazily so that `vllm --help` and the torch-free
core (`vllm.v1.core`) stay cheap to import.
"""

from vllm.version import __version__

_LAZY = {
    "LLM": "vllm.entrypoints.llm",
    "SamplingParams": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
    "EngineArgs": "vllm.engine.arg_utils",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
