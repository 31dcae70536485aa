"""How the engine starts its processes: spawned, without importing the user's main
script again, so a script without an `if __name__ == "__main__":` guard works (issue 44).

The end-to-end test runs a real script in a fresh interpreter: no guard, and
tensor_parallel_size=2 on the bundled model (CPU, gloo), as a user's first try
would. Before, every spawned worker ran the script again, and start-up died with
"worker rank 0 died (exit code 1 during start-up)" and a recursion traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from tests.entrypoints.openai.utils import REPO_ROOT
from vllm.v1.executor import process_start

GUARDLESS = textwrap.dedent("""
    import torch
    # Parallel CPU work first: a forked worker would inherit this OpenMP pool and hang.
    x = torch.randn(256, 256)
    for _ in range(4):
        x = torch.tanh(x @ x)
    from vllm import LLM, SamplingParams
    print("SCRIPT RUNS", flush=True)  # once: the workers must not run it again
    llm = LLM(tensor_parallel_size=2, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_memory_bytes=32 * 2**20)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    print("OUTPUT", repr(out[0].outputs[0].text), flush=True)
""")


def _child_main_file(queue) -> None:
    queue.put(getattr(sys.modules["__main__"], "__file__", None))


def test_a_spawned_child_does_not_import_the_main_script(tmp_path, monkeypatch):
    """The child's __main__ is spawn's own: the script's file is not run there, and the
    parent's __main__ is as it was once the child started."""
    main = type(sys)("__main__")
    main.__file__ = str(tmp_path / "script.py")
    main.__spec__ = None
    (tmp_path / "script.py").write_text("raise SystemExit('the script ran in the child')\n")
    monkeypatch.setitem(sys.modules, "__main__", main)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_main_file, args=(queue,))
    process_start.start(child)
    assert queue.get(timeout=60) is None
    child.join(30)
    assert child.exitcode == 0
    assert main.__file__ == str(tmp_path / "script.py") and main.__spec__ is None


def test_the_start_method_is_spawn_unless_asked(monkeypatch):
    from vllm import envs

    assert process_start.start_method() == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    envs.reset()
    assert process_start.start_method() == "fork"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    envs.reset()
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD='forkserver' must be "
                                         "fork or spawn"):
        process_start.start_method()


@pytest.mark.slow
def test_a_guardless_tp2_script_works(tmp_path):
    """What a vLLM user writes first: no guard, and the CPU already ran parallel work."""
    (tmp_path / "script.py").write_text(GUARDLESS)
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("SCRIPT RUNS") == 1, result.stdout
    assert "OUTPUT ' Paris" in result.stdout, result.stdout[-2000:]
    assert "Started 2 worker processes (spawn;" in result.stdout + result.stderr


def _child_signal_dispositions(queue) -> None:
    import signal

    queue.put((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
    signal.pause()  # until the parent's stop request ends it


def test_a_child_starts_with_group_signals_ignored_and_stops_on_request():
    """A signal to the process group must not reach a child's interpreter before its
    entry point runs (a Ctrl-C during its imports was a traceback): the child starts
    with SIGINT and SIGTERM ignored, the parent's own handlers are back afterwards, and
    `request_stop` (not SIGTERM) ends the child."""
    import signal

    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_signal_dispositions, args=(queue,))
    process_start.start(child)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert queue.get(timeout=60) == (signal.SIG_IGN, signal.SIG_IGN)
    os.kill(child.pid, signal.SIGTERM)  # the group's signal: ignored
    child.join(0.5)
    assert child.exitcode is None
    process_start.request_stop(child)
    child.join(30)
    assert child.exitcode == -process_start.STOP_SIGNAL
