"""Shared test setup: the `cuda` marker skips cleanly where no NVIDIA GPU is present; one
offline engine on the bundled model for every module that only reads from it (the greedy
reference of the server and tensor-parallel tests), and one transformers model of the same
file as the reference.

Run in parallel (`make test` passes `-n 2 --dist loadfile` to pytest-xdist on a CPU
machine with two or more CPUs): every module runs whole on one worker (its module-scoped
engines start once); each worker is pinned to its own CPU, so its engines plan one compute
thread there (the same rule as on a one-core machine) and the two workers do not contend
for one core's OpenMP barriers; and each worker has its own Ray temp directory, since
`ray.init()` without an address joins the local cluster recorded there. The slowest
modules are collected first, so that no worker ends with a long one while the other waits.
"""

import os
import tempfile

import pytest


def _isolate_xdist_worker() -> None:
    """Give this pytest-xdist worker (and every process it starts) its own Ray temp
    directory and, when there are at least as many allowed CPUs as workers, its own CPU.

    A serial run (no PYTEST_XDIST_WORKER) is left as it is.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray-{os.getuid()}-{os.getppid()}-{worker}")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    allowed = sorted(os.sched_getaffinity(0))
    if 2 <= count <= len(allowed):
        os.sched_setaffinity(0, {allowed[int(worker[2:]) % count]})


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.version.hip is None


def pytest_configure(config):
    from tests.signal_guard import ignored_at_start

    if reason := ignored_at_start():
        config.issue_config_time_warning(pytest.PytestConfigWarning(reason), stacklevel=2)
    _isolate_xdist_worker()
    # Elastic engines of this run (and of this xdist worker) share a registry of their
    # own, never the registry of engines the machine runs outside the tests.
    os.environ["VLLM_KV_REGISTRY_DIR"] = tempfile.mkdtemp(prefix="vllm-kv-registry-")
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (CUDA); skipped without one")
    if not _cuda_available():
        # The test process computes (transformers references, model tests) with the
        # threads an engine would choose, from the start: otherwise its speed depends on
        # whether an engine happened to be built earlier in the session, and torch's
        # default (every core) runs ~10x slower on a loaded machine (issue 17).
        from vllm.platforms.cpu_threads import apply_cpu_thread_plan, plan_cpu_threads_from_env

        apply_cpu_thread_plan(plan_cpu_threads_from_env())


# The slowest modules on a 2-core CPU machine (serial `--durations`, 2026-12-03), slowest
# first: a parallel run starts them first, so no worker is left with a long one at the end.
_SLOW_MODULES = [
    "tests/entrypoints/openai/test_structured_outputs.py",  # 2 x 100 requests over HTTP
    "tests/v1/structured_output/test_offline.py",  # 100 replies, with and without ngram
    "tests/distributed/kv_transfer/test_nixl_disagg.py",
    "tests/entrypoints/openai/test_errors.py",
    "tests/entrypoints/openai/test_processes.py",
    "tests/entrypoints/openai/test_cli.py",
    "tests/v1/e2e/test_elastic_kv_cache.py",
    "tests/v1/e2e/test_sleep.py",
    "tests/v1/e2e/test_tensor_parallel.py",
    "tests/v1/e2e/test_offline_engine.py",
    "tests/entrypoints/openai/test_elastic_server.py",
    "tests/v1/spec_decode/test_spec_decode_e2e.py",
    "tests/distributed/kv_transfer/test_offloading_connector.py",
    "tests/v1/spec_decode/test_draft_model_e2e.py",
    "tests/v1/e2e/test_kv_cache_fit.py",
]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order
        rank = {module: i for i, module in enumerate(_SLOW_MODULES)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_envs():
    """`vllm.envs` parses each VLLM_* variable once per process: drop the parsed values
    before and after every test, so a test's monkeypatch.setenv is seen and undone. A test
    that changes a variable after something read it calls `envs.reset()` itself."""
    from vllm import envs

    envs.reset()
    yield
    envs.reset()


@pytest.fixture(autouse=True)
def _group_signals_kept():
    """A test leaves this process's SIGINT / SIGTERM handling as it found it: restored
    here, with a warning naming the test that changed it (tests/signal_guard.py)."""
    from tests import signal_guard

    before = signal_guard.handlers()
    yield
    signal_guard.restore(before, "the test")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Every fixture, of any scope, leaves SIGINT / SIGTERM as it found them at its
    setup and at its teardown (tests/signal_guard.py): a module- or session-scoped one
    escapes `_group_signals_kept`, which sees only what a test changes."""
    from tests import signal_guard

    before = signal_guard.handlers()
    name = f"fixture {fixturedef.argname!r} ({fixturedef.scope}-scoped)"
    # Added before the fixture's own finalizer, so it runs after that one (LIFO).
    fixturedef.addfinalizer(lambda: signal_guard.restore(before, f"{name} teardown"))
    try:
        return (yield)
    finally:
        signal_guard.restore(before, f"{name} setup")


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
