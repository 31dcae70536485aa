"""Shared test setup: the `cuda` marker skips cleanly where no NVIDIA GPU is present; one
offline engine on the bundled model for every module that only reads from it (the greedy
reference of the server and tensor-parallel tests), and one transformers model of the same
file as the reference."""

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.version.hip is None


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (CUDA); skipped without one")
    if not _cuda_available():
        # The test process computes (transformers references, model tests) with the
        # threads an engine would choose, from the start: otherwise its speed depends on
        # whether an engine happened to be built earlier in the session, and torch's
        # default (every core) runs ~10x slower on a loaded machine (issue 17).
        from vllm.platforms.cpu_threads import apply_cpu_thread_plan, plan_cpu_threads

        apply_cpu_thread_plan(plan_cpu_threads())


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


@pytest.fixture(scope="session")
def offline_llm(bundled_llm):
    """The offline engine (one rank, in this process): the greedy reference."""
    return bundled_llm


@pytest.fixture(scope="session")
def bundled_hf_model():
    """transformers' own model for the bundled GGUF (fp32, eval): the greedy reference.

    Loading it dequantizes the whole file; one copy serves every module that compares
    against it.
    """
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from vllm.transformers_utils.config import get_bundled_model_path

    path = Path(get_bundled_model_path())
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


# Prompts and greedy parameters every tensor-parallel test compares on.
TP_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]


@pytest.fixture(scope="session")
def tp_reference(offline_llm):
    """{prompt: (greedy token ids, text)} of the one-rank engine, 16 tokens each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = offline_llm.generate(TP_PROMPTS, params, use_tqdm=False)
    return {o.prompt: (list(o.outputs[0].token_ids), o.outputs[0].text) for o in outputs}


@pytest.fixture
def limited_memory(monkeypatch):
    """For `tests.v1.e2e.tp_workers.LimitedMemoryWorker`: rank 1 sees 200 MiB free, rank 0
    1 GiB. Rank 1 then bounds the block count of the bundled model although its blocks
    are half as large (1 of SmolLM2's 3 KV heads against 2). VLLM_* variables reach
    every worker process and Ray actor."""
    mib = 1 << 20
    monkeypatch.setenv("VLLM_TEST_FREE_BYTES", f"{1024 * mib},{200 * mib}")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: rank 0's cap
