"""Helpers the end-to-end tests share (fixtures: conftest.py)."""

from __future__ import annotations

import gc

from vllm import LLM


def shutdown_llm(llm: LLM) -> None:
    """Stop an offline `LLM`'s engine and return its memory before the next one starts
    (the device's cached blocks too, where CUDA was used)."""
    import torch

    llm.llm_engine.shutdown()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
