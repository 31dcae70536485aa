"""The test process's SIGINT / SIGTERM handling, kept as the session found it.

An ignored SIGINT is inherited by every process a later test starts, and Python then
leaves it ignored: a `vllm serve` that Ctrl-C cannot stop (test_signals failed twice in
CI, 2026-12-07). tests/conftest.py checks around every test (`_group_signals_kept`) and
around every fixture's setup and teardown, module- and session-scoped ones included
(`pytest_fixture_setup`): what changed either is restored, with a warning naming it.

Searched for on 2026-12-07 with a probe that read both Python's handler and the kernel's
(SigIgn / SigBlk in /proc/self/status) around every fixture, test and collection of a
full `-n 2 --dist loadfile` run: nothing in the suite left SIGINT ignored. The same
state comes from outside: a pytest started as a background job (`cmd &`) of a
non-interactive shell starts with SIGINT ignored (POSIX), and so do its xdist workers;
`ignored_at_start` says so once, at configuration.
"""

from __future__ import annotations

import signal
import warnings
from typing import Any

GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def handlers() -> dict[int, Any]:
    """Python's handler of each group signal now (None: set outside Python)."""
    return {sig: signal.getsignal(sig) for sig in GROUP_SIGNALS}


def restore(before: dict[int, Any], culprit: str) -> list[str]:
    """Put back the handlers of `before` that changed since, warning with `culprit`'s
    name; returns the names of the signals restored. A handler set outside Python
    (None in `before`) cannot be set again and is left as it is."""
    restored = []
    for sig, handler in before.items():
        now = signal.getsignal(sig)
        if now is not handler and handler is not None:
            signal.signal(sig, handler)
            name = signal.Signals(sig).name
            restored.append(name)
            warnings.warn(f"{culprit} left {name} handled by {now!r} (was {handler!r}); "
                          "restored", stacklevel=2)
    return restored


def ignored_at_start() -> str | None:
    """Why this process's SIGINT is ignored before any test ran, or None when it is not."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return None
    return ("this pytest process started with SIGINT ignored, inherited from what launched "
            "it (a background job `cmd &` of a non-interactive shell is started so); every "
            "process a test starts inherits it, so Ctrl-C tests of `vllm serve` cannot pass "
            "unless they reset it in the child")
