"""tests/signal_guard.py: what a fixture of any scope, or a test, does to this process's
SIGINT / SIGTERM is undone and named; a SIGINT ignored from the start is reported."""

from __future__ import annotations

import re
import signal

import pytest

from tests import signal_guard

LEAK = "fixture '_ignores_sigint_for_the_module' (module-scoped) setup left SIGINT"


@pytest.fixture(scope="module")
def _ignores_sigint_for_the_module():
    """Sets SIGINT as a module-scoped engine or cluster could, and never undoes it:
    `_group_signals_kept` (around each test) cannot see that, since each test starts
    with it already set. Returns the handler it found."""
    found = signal.getsignal(signal.SIGINT)
    # SIG_IGN, or SIG_DFL in a run launched with SIGINT ignored: a change either way.
    signal.signal(signal.SIGINT, signal.SIG_DFL if found is signal.SIG_IGN else signal.SIG_IGN)
    yield found


@pytest.mark.filterwarnings(f"ignore:{re.escape(LEAK)}")
def test_a_module_scoped_fixture_leaves_sigint_as_it_found_it(
        _ignores_sigint_for_the_module):
    assert signal.getsignal(signal.SIGINT) is _ignores_sigint_for_the_module


def test_restore_puts_back_what_changed_and_names_who_changed_it():
    before = signal_guard.handlers()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with pytest.warns(UserWarning, match=r"^fixture 'x' teardown left SIGTERM handled by "
                                         r"<Handlers.SIG_IGN: 1> \(was "):
        assert signal_guard.restore(before, "fixture 'x' teardown") == ["SIGTERM"]
    assert signal_guard.handlers() == before
    assert signal_guard.restore(before, "nobody") == []


def test_a_sigint_ignored_from_the_start_is_reported(monkeypatch):
    # Not this process's own state: a run launched with SIGINT ignored is one to report.
    monkeypatch.setattr(signal_guard.signal, "getsignal", lambda sig: signal.default_int_handler)
    assert signal_guard.ignored_at_start() is None
    monkeypatch.setattr(signal_guard.signal, "getsignal", lambda sig: signal.SIG_IGN)
    assert "started with SIGINT ignored" in signal_guard.ignored_at_start()
