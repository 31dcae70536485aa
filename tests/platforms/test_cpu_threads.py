"""vLLM's CPU thread rules: one compute thread per physical core the process may use, one
core reserved, VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.entrypoints.openai.utils import REPO_ROOT
from vllm import envs
from vllm.platforms.cpu_threads import (
    check_cpu_threads_env,
    parse_cpu_list,
    plan_cpu_threads,
    plan_cpu_threads_from_env,
)

# Four logical CPUs, two physical cores with two threads each (Linux numbers siblings
# apart: cpu0 and cpu2 share core 0), one NUMA node.
SMT = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 0, 0), 3: (0, 0, 1)}
# Two NUMA nodes of four cores each, no SMT.
TWO_NODES = {cpu: (cpu // 4, cpu // 4, cpu % 4) for cpu in range(8)}


def _plan(bind="auto", reserved=None, allowed=(0, 1, 2, 3), topology=SMT, rank=0):
    return plan_cpu_threads(bind, reserved, list(allowed), topology, rank)


def test_auto_takes_one_thread_per_physical_core_less_one_reserved():
    plan = _plan()
    assert (plan.num_threads, plan.cpus) == (1, (0,))
    assert "2 physical core(s) allowed, 1 reserved" in plan.description
    plan = _plan(reserved=0)
    assert (plan.num_threads, plan.cpus) == (2, (0, 1))


def test_auto_keeps_to_the_affinity_mask_and_the_first_numa_node():
    assert _plan(allowed=(2, 3)).cpus == (2,)  # cpu2 and cpu3 are two cores: one reserved
    assert _plan(allowed=(1, 3)).cpus == (1,)  # siblings of one core: one thread, none reserved
    plan = _plan(allowed=range(8), topology=TWO_NODES)
    assert plan.cpus == (0, 1, 2)  # node 0's four cores, the last one reserved
    plan = _plan(allowed=range(4, 8), topology=TWO_NODES)
    assert plan.cpus == (4, 5, 6)


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
