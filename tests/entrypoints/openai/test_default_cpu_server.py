"""A default CPU `vllm serve` of the bundled model costs what it holds (issue 48).

Before: ~5 GB of RSS at idle, the 4 GiB KV budget committed and pre-faulted at start-up.
Now the CPU's fixed-size KV cache commits lazily (host pages resident once a block is
written) and start-up's freed heap goes back to the OS, so the server at idle holds the
weights, the libraries and the few KV blocks warmup and a request wrote.

What the server holds is the PSS (proportional set size) summed over its process tree
(the API server, the engine core and multiprocessing's resource tracker): resident pages,
each page shared between processes (libtorch and the other libraries both main processes
map) split between them, so it is counted once. Summed plain RSS counts those pages once
per process: 1.38 GB in the development venv (Python 3.12), 1.53 GB in CI's fresh
Python 3.11 venv, whose PSS sum read 1.26 GB (2026-12-07).
"""

from __future__ import annotations

import re
import time

import psutil
import pytest
import torch

from tests.entrypoints.openai.utils import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform's default")

IDLE_RSS_LIMIT = 1_500_000_000  # bytes: the "< 1.5 GB"


def _tree_rss(pid: int) -> tuple[int, dict[int, tuple[int, int]]]:
    """(PSS summed over the tree, {pid: (PSS, RSS)}), bytes."""
    root = psutil.Process(pid)
    per_process = {}
    for p in [root, *root.children(recursive=True)]:
        info = p.memory_full_info()
        per_process[p.pid] = (info.pss, info.rss)
    return sum(pss for pss, _ in per_process.values()), per_process


@pytest.fixture(scope="module")
def default_server():
    with RemoteServer(["--uvicorn-log-level", "warning"]) as server:
        yield server


def test_idle_default_cpu_server_holds_under_1_5_gb(default_server):
    # The default budget (min(4 GiB, available memory)) is committed, not resident.
    committed = re.search(r"KV committed ([\d.]+) GiB \(host pages resident only once a block "
                          r"is written\)", default_server.startup_log)
    assert committed and float(committed.group(1)) > 1.0
    time.sleep(1.0)  # idle
    total, per_process = _tree_rss(default_server.proc.pid)
    assert len(per_process) >= 2  # the API server and the engine core at least
    assert total < IDLE_RSS_LIMIT, f"(PSS, RSS) per process: {per_process}"

    reply = default_server.get_client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    after, per_process = _tree_rss(default_server.proc.pid)
    # One short request writes a few blocks (~0.7 MiB each), not the budget.
    assert after - total < 64 * 2**20, f"(PSS, RSS) per process: {per_process}"
    assert after < IDLE_RSS_LIMIT


def test_the_start_up_line_says_how_many_threads_compute(default_server):
    line = next(li for li in default_server.startup_log.splitlines() if "CPU threads:" in li)
    if "OpenMP team of" in line:
        assert "computing now: other processes kept" in line
        assert "computing on those other processes leave idle" in line
