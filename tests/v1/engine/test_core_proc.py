"""The engine core process's start-up: the frontend counts as this engine, a busy
device is one log line (the frontend prints it; no traceback in the log), and a
process started before its configuration (`core_launcher`) waits for it."""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from vllm.exceptions import DeviceBusyError
from vllm.platforms import current_platform
from vllm.v1.engine import core_proc
from vllm.v1.executor import process_start

MESSAGE = ("another process holds memory on cuda:0 (pid 4242 trainer (3.0 GiB)) and "
           "--gpu-memory-utilization was left to its default (all of the device on the "
           "extensible path)")


@pytest.fixture
def quiet_entry(monkeypatch):
    """The entry point's process-wide side effects, kept out of the test process; returns
    the (signal, handler) settings it made, in order."""
    settings: list[tuple] = []
    monkeypatch.setattr(core_proc.signal, "signal", lambda *args: settings.append(args))
    monkeypatch.setattr(process_start.signal, "signal", lambda *args: settings.append(args))
    monkeypatch.setattr(core_proc, "_exit_with_parent", lambda pid: None)
    monkeypatch.setattr("vllm.logger.set_process_label", lambda label: None)
    return settings


def _last_stop_handler(settings: list[tuple]):
    return [handler for signum, handler in settings if signum == process_start.STOP_SIGNAL][-1]


def test_a_busy_device_fails_start_up_in_one_line_with_the_frontend_as_this_engine(
        monkeypatch, caplog, quiet_entry):
    frontend_pid = os.getpid() + 100000  # any pid: only its registration is checked
    seen: list[frozenset[int]] = []

    def busy_core(*args, **kwargs):
        seen.append(current_platform.engine_pids())  # what the worker's check excludes
        raise DeviceBusyError(MESSAGE)

    monkeypatch.setattr(core_proc, "EngineCoreProc", busy_core)
    monkeypatch.setattr(current_platform, "_engine_pids", set())  # restored afterwards
    parent, child = Pipe()
    with caplog.at_level(logging.ERROR, logger="vllm"), pytest.raises(SystemExit) as info:
        core_proc.run_engine_core(SimpleNamespace(), "", "", child, frontend_pid)
    assert info.value.code == 1
    assert seen and frontend_pid in seen[0]
    kind, failure = parent.recv()
    assert kind == "startup_failed"
    records = [r for r in caplog.records if "start-up failed" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None, records
    assert records[0].getMessage() == f"engine core start-up failed: {MESSAGE}"
    assert _last_stop_handler(quiet_entry) is signal.SIG_DFL  # none inside atexit hooks


def test_a_prestarted_process_builds_from_the_config_it_is_sent(monkeypatch, quiet_entry):
    built = []

    def core(config, *addresses):
        built.append((config, addresses))
        raise DeviceBusyError(MESSAGE)  # stop right after the build starts

    monkeypatch.setattr(core_proc, "EngineCoreProc", core)
    monkeypatch.setattr(current_platform, "_engine_pids", set())
    config_recv, config_send = Pipe(duplex=False)
    _, status = Pipe()
    config = SimpleNamespace(name="the config")
    config_send.send(config)
    with pytest.raises(SystemExit):
        core_proc.run_engine_core(None, "in", "out", status, os.getpid(), config_recv)
    assert built == [(config, ("in", "out"))]
    assert config_recv.closed


def test_a_prestarted_process_whose_frontend_gives_up_exits_quietly(monkeypatch, quiet_entry):
    monkeypatch.setattr(core_proc, "EngineCoreProc", lambda *a: pytest.fail("built"))
    config_recv, config_send = Pipe(duplex=False)
    _, status = Pipe()
    config_send.close()  # the frontend failed before it had a configuration
    assert core_proc.run_engine_core(None, "in", "out", status, os.getpid(), config_recv) is None
    # The frontend stops a process it gave up on just as the closed pipe lets it
    # return: a stop signal during its atexit hooks must not raise SystemExit inside one (a
    # traceback on the frontend's stderr, seen in test_cli's one-line start-up errors).
    assert _last_stop_handler(quiet_entry) is signal.SIG_DFL


def test_the_engine_core_leaves_group_signals_to_the_frontend(monkeypatch, quiet_entry):
    """SIGINT and SIGTERM (a signal to the process group) are ignored: the frontend
    drains, then stops the engine with STOP_SIGNAL, which ends its loop."""
    monkeypatch.setattr(core_proc, "EngineCoreProc", lambda *a: (_ for _ in ()).throw(
        DeviceBusyError(MESSAGE)))
    monkeypatch.setattr(current_platform, "_engine_pids", set())
    with pytest.raises(SystemExit):
        core_proc.run_engine_core(SimpleNamespace(), "", "", Pipe()[1], os.getpid())
    handlers = dict(quiet_entry[:3])
    assert handlers[signal.SIGINT] is signal.SIG_IGN
    assert handlers[signal.SIGTERM] is signal.SIG_IGN
    assert handlers[process_start.STOP_SIGNAL] is core_proc._raise_system_exit
