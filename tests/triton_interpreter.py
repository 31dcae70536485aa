"""Shared test helper: run Triton kernel checks on the CPU under TRITON_INTERPRET=1.

TRITON_INTERPRET=1 must be set before the kernels are decorated, which a pytest
process that may already have imported them cannot promise. So a test module
keeps its interpreted cases in a module-level `_run_interpreted_cases()` (built
on `run_checks`), and a module-scoped fixture calls `run_interpreted(module, timeout_s)`:
ONE subprocess started with the variable set imports the module, runs the cases
and prints one JSON line, name -> "ok" or the traceback. Each parametrised test
then calls `check_result(results, name)`.

```
pytest process                              subprocess (TRITON_INTERPRET=1)
--------------                              -------------------------------
fixture: run_interpreted(module) --------->  import module; module._run_interpreted_cases()
                                              run_checks: check(case, "cpu") per case
         <---- "INTERPRETED_RESULTS={json}"   (SKIP_KEY -> reason when the probe fails)
test_interpreted[name]: check_result(results, name)
```

Used by tests/v1/attention/test_triton_kernels.py and
tests/model_executor/test_fused_ops.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
REPO_ROOT = Path(__file__).resolve().parents[1]
# The results entry that means "skip every interpreted case", with the reason as its value.
SKIP_KEY = "__skip__"
_RESULT_MARK = "INTERPRETED_RESULTS="


def interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None.

    Triton 3.6's interpreter turns loop bounds into ints with int() on 1-element
    arrays, which NumPy >= 2.4 rejects (fixed in Triton 3.9); kernels that loop
    over runtime bounds can then only be tested on CUDA.
    """
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(out_ptr, n):
        total = 0
        for _ in range(0, n):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _probe[(1,)](out, 3)
    except Exception as e:  # the interpreter's own failure, reported as the skip reason
        import numpy

        return (
            f"triton {triton.__version__}'s interpreter cannot loop over runtime bounds "
            f"with numpy {numpy.__version__}: {e}"
        )
    return None if int(out[0]) == 3 else f"interpreter probe returned {int(out[0])}, expected 3"


def run_checks(
    groups: Iterable[tuple[Callable[[Any, str], None], Sequence[Any]]],
    *,
    probe: bool = False,
) -> dict[str, str]:
    """Run `check(case, "cpu")` for every case of every (check, cases) group.

    Args:
        groups: (check, cases) pairs; each case has a unique `.name`.
        probe: first run `interpreter_problem()`; a problem returns
            `{SKIP_KEY: reason}` and runs nothing.

    Returns:
        case name -> "ok", or the formatted traceback of the failed check.
    """
    if probe:
        problem = interpreter_problem()
        if problem is not None:
            return {SKIP_KEY: problem}
    results = {}
    for check, cases in groups:
        for case in cases:
            try:
                check(case, "cpu")
                results[case.name] = "ok"
            except Exception:  # reported per case by the parent process
                results[case.name] = traceback.format_exc()
    return results


def run_interpreted(module: str, timeout_s: float) -> dict[str, str]:
    """`module._run_interpreted_cases()` run in a subprocess with TRITON_INTERPRET=1.

    Args:
        module: dotted name of the test module (e.g. "tests.v1.attention.test_triton_kernels").
        timeout_s: wall-clock limit of the subprocess, seconds.

    Returns:
        The function's results (see `run_checks`). Fails the calling test
        (pytest.fail) when the subprocess prints no result line.
    """
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    code = (
        f"import json, {module} as t; "
        f"print({_RESULT_MARK!r} + json.dumps(t._run_interpreted_cases()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK) :])
    pytest.fail(
        f"interpreter subprocess failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )


def check_result(results: dict[str, str], name: str) -> None:
    """Skip when the interpreter cannot run the kernels; else assert case `name` passed."""
    if SKIP_KEY in results:
        pytest.skip(results[SKIP_KEY])
    assert results[name] == "ok", results[name]
