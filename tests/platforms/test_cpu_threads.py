"""The CPU thread rules: an OpenMP team of one thread per physical core the process may use,
as many computing as other processes leave idle (`CpuThreadGovernor`) unless a reserve is
set, VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.entrypoints.openai.utils import REPO_ROOT
from vllm import envs
from vllm.platforms.cpu_threads import (
    CpuThreadGovernor,
    check_cpu_threads_env,
    parse_cpu_list,
    plan_cpu_threads,
    plan_cpu_threads_from_env,
    read_busy_seconds,
)

# Four logical CPUs, two physical cores with two threads each (Linux numbers siblings
# apart: cpu0 and cpu2 share core 0), one NUMA node.
SMT = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 0, 0), 3: (0, 0, 1)}
# Two NUMA nodes of four cores each, no SMT.
TWO_NODES = {cpu: (cpu // 4, cpu // 4, cpu % 4) for cpu in range(8)}


def _plan(bind="auto", reserved=None, allowed=(0, 1, 2, 3), topology=SMT, rank=0):
    return plan_cpu_threads(bind, reserved, list(allowed), topology, rank)


def test_auto_takes_every_physical_core_adaptively_unless_a_reserve_is_set():
    plan = _plan()
    assert (plan.num_threads, plan.cpus, plan.adaptive) == (2, (0, 1), True)
    assert "computing on those other processes leave idle" in plan.description
    plan = _plan(reserved=1)
    assert (plan.num_threads, plan.cpus, plan.adaptive) == (1, (0,), False)
    assert "2 physical core(s) allowed, 1 reserved" in plan.description
    plan = _plan(reserved=0)
    assert (plan.num_threads, plan.cpus, plan.adaptive) == (2, (0, 1), False)
    assert _plan(allowed=(0,)).adaptive is False  # one CPU: nothing to adapt


def test_auto_keeps_to_the_affinity_mask_and_the_first_numa_node():
    assert _plan(allowed=(2, 3)).cpus == (2, 3)  # cpu2 and cpu3 are two cores
    assert _plan(allowed=(2, 3), reserved=1).cpus == (2,)
    plan = _plan(allowed=(1, 3))
    assert (plan.cpus, plan.adaptive) == ((1,), False)  # siblings of one core: one thread
    plan = _plan(allowed=range(8), topology=TWO_NODES, reserved=1)
    assert plan.cpus == (0, 1, 2)  # node 0's four cores, the last one reserved
    plan = _plan(allowed=range(4, 8), topology=TWO_NODES)
    assert plan.cpus == (4, 5, 6, 7)


class _Machine:
    """A clock, the plan's CPUs' busy seconds and this process's CPU seconds, advanced by
    hand: `run(seconds, ours, others)` = that many wall seconds with `ours` and `others`
    cores busy."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0

    def run(self, seconds, ours, others):
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def _governor(machine, cores=2):
    return CpuThreadGovernor(tuple(range(cores)), busy=lambda: machine.busy,
                             own=lambda: machine.own, clock=lambda: machine.now)


@pytest.fixture
def keep_torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.mark.usefixtures("keep_torch_threads")
def test_the_governor_computes_on_the_cores_others_leave_idle():
    m = _Machine()
    g = _governor(m)
    m.run(1.0, ours=2.0, others=0.05)  # alone but for the server's frontend
    assert g.adjust() == 2
    m.run(1.0, ours=1.0, others=1.0)  # another process takes a core
    assert g.adjust() == 1 == torch.get_num_threads()
    assert g.others_cores == pytest.approx(1.0)
    m.run(0.5, ours=1.0, others=0.0)  # it left, but a second has not passed: no reading
    assert g.adjust() == 1
    m.run(0.5, ours=1.0, others=0.0)
    assert g.adjust() == 2 == torch.get_num_threads()
    m.run(1.0, ours=1.34, others=0.66)  # CFS shares 2 cores among our 2 threads and 1 other
    assert g.adjust() == 1
    m.run(1.0, ours=1.0, others=5.0)  # a heavily loaded machine: still one thread
    assert g.adjust() == 1


@pytest.mark.usefixtures("keep_torch_threads")
def test_the_governor_on_a_bigger_machine_leaves_the_busy_cores():
    m = _Machine()
    g = _governor(m, cores=8)
    m.run(1.0, ours=8.0, others=0.1)
    assert g.adjust() == 8
    m.run(1.0, ours=5.5, others=2.5)  # 2.5 cores busy elsewhere: 3 left to them
    assert g.adjust() == 5


def test_busy_seconds_come_from_the_plan_cpus_lines_of_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    # cpu  user nice system idle iowait irq softirq steal ...
    stat.write_text("cpu  900 0 900 9000 0 0 0 0 0 0\n"
                    "cpu0 100 10 50 4000 7 1 2 3 0 0\n"
                    "cpu1 800 0 850 5000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert read_busy_seconds((0,), str(stat)) == pytest.approx(166 / hz)  # idle, iowait out
    assert read_busy_seconds((0, 1), str(stat)) == pytest.approx((166 + 1650) / hz)


def test_explicit_cpu_lists_per_rank():
    assert _plan("0-1|2-3").cpus == (0, 1)
    assert _plan("0-1|2-3", rank=1).cpus == (2, 3)
    with pytest.raises(ValueError, match="none for rank 2"):
        _plan("0-1|2-3", rank=2)


def test_nobind_leaves_the_count_to_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plan = _plan("nobind")
    assert (plan.num_threads, plan.cpus) == (None, None)
    assert "OMP_NUM_THREADS=3" in plan.description


@pytest.mark.parametrize(("bind", "message"), [
    ("all-of-them", "VLLM_CPU_OMP_THREADS_BIND: 'all-of-them' is not a CPU list"),
    ("3-1", "is not a CPU list"),
    ("0,9", r"names CPU\(s\) \[9\] this process may not use"),
])
def test_malformed_settings_are_rejected_naming_the_variable(bind, message):
    with pytest.raises(ValueError, match=message):
        _plan(bind)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("VLLM_CPU_OMP_THREADS_BIND", "all-of-them", "VLLM_CPU_OMP_THREADS_BIND: 'all-of-them' "
                                                  "is not a CPU list"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "one", "VLLM_CPU_NUM_OF_RESERVED_CPU='one' must be a "
                                            "whole number of cores"),
])
def test_the_start_up_check_reads_the_variables(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        check_cpu_threads_env()


def test_the_process_plan_takes_the_variables(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(allowed[0]))
    plan = plan_cpu_threads_from_env()
    assert (plan.num_threads, plan.cpus) == (1, (allowed[0],))
    assert plan.description == f"VLLM_CPU_OMP_THREADS_BIND={allowed[0]}"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert plan_cpu_threads_from_env().cpus == (allowed[0],)  # parsed once: still the first
    envs.reset()
    assert plan_cpu_threads_from_env().cpus is None


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]


_APPLY = """
import os, torch
from vllm.platforms.cpu_threads import CpuThreadPlan, apply_cpu_thread_plan

def masks():
    out = []
    for tid in os.listdir('/proc/self/task'):
        with open(f'/proc/self/task/{tid}/status') as f:
            out += [l.split()[1] for l in f if l.startswith('Cpus_allowed_list')]
    return out

os.sched_setaffinity(0, {0})  # the caller's own mask, narrower than the plan's
before = masks().count('0-1')
apply_cpu_thread_plan(CpuThreadPlan(2, (0, 1), 'test'))
print(torch.get_num_threads(), masks().count('0-1') - before, sorted(os.sched_getaffinity(0)))
"""


# The child sets its own masks: it needs two CPUs on the machine, not in this process's
# mask (a parallel run pins each pytest worker to one CPU).
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
def test_apply_starts_the_openmp_team_on_the_plan_cpus_and_restores_the_caller():
    result = subprocess.run([sys.executable, "-c", _APPLY], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                         "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    threads, new_workers_on_plan, caller = result.stdout.split(maxsplit=2)
    assert int(threads) == 2
    assert int(new_workers_on_plan) == 1  # the team's second thread, on CPUs 0-1
    assert caller.strip() == "[0]"  # the caller's mask came back
