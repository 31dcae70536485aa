"""How many threads compute on the CPU, and on which cores: vLLM's CPU backend rules.

Environment (vLLM's names and meanings; parsed in vllm/envs.py):

    VLLM_CPU_OMP_THREADS_BIND     "auto" (default): the OpenMP team has one thread per
                                  physical core this process may use (its affinity
                                  mask), on the first NUMA node that has such cores,
                                  bound to those cores, less the reserved cores (the
                                  last ones); with no reserve set, as many of them
                                  compute as other processes leave idle (below).
                                  "nobind": leave the thread count to torch
                                  (OMP_NUM_THREADS, else one per core) and bind nothing.
                                  A CPU list, "0-3,8" (rank i of "0-3|4-7" takes list
                                  i): one thread per listed CPU, bound to them.
    VLLM_CPU_NUM_OF_RESERVED_CPU  cores kept free of compute threads under "auto", a
                                  fixed count (vLLM reserves one for its frontend).
                                  Unset (the default here): none reserved up front;
                                  `CpuThreadGovernor` measures instead.

Why it matters: the OpenMP threads of torch spin at every barrier of every op.
With more threads than free cores (torch's default counts every logical CPU,
and other processes or the server's own threads compete for them) each op
waits for a descheduled thread: on a loaded 2-core machine the offline LLM ran
~10x slower with torch's default 2 threads than with 1 (issue 17).

Both cores when the engine is alone, fewer when it is not (issue 48): the rule of a
fixed reserve left a 2-core machine one compute thread although the server's other
process (HTTP, tokenizer, detokenizer) used 0.01 of a core while the engine used 0.46,
and any fixed count is wrong half the time on a shared machine: two threads beside
one busy process ran 3-12x slower than one thread. So with no reserve set the
engine starts the team on every core and, between steps, once a second
(`CpuThreadGovernor`), reads how busy the plan's CPUs were (/proc/stat) less its
own CPU time (os.times): the cores other processes keep busy. It computes with
the plan's cores less ceil(others - 0.2) (a fifth of a core passes free), at least one.

Binding: the threads of torch's OpenMP team are created with the chosen cores
as their affinity mask (the calling thread's mask is narrowed while the team
starts, then restored), so the compute threads stay on their cores while the
calling thread, which is the caller's own (the main thread under `LLM`), keeps
its mask. Sources: vLLM's CPU installation page ("Related runtime environment
variables") and its OpenMP process manager.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

_SYS_CPU = Path("/sys/devices/system/cpu")
_SYS_NODE = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class CpuThreadPlan:
    """The compute threads: how many, and the CPUs they are bound to (None: not bound)."""

    num_threads: int | None  # None: torch's own choice (nobind); the team's size
    cpus: tuple[int, ...] | None
    description: str  # for the start-up log line
    adaptive: bool = False  # the count follows the idle cores (`CpuThreadGovernor`)


def parse_cpu_list(text: str) -> list[int]:
    """`"0-3,8"` -> [0, 1, 2, 3, 8] (the kernel's cpulist format).

    Raises:
        ValueError: not a CPU list; the message quotes it.
    """
    cpus: list[int] = []
    try:
        for part in text.strip().split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError
            cpus.extend(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"{text!r} is not a CPU list like '0-3,8'") from None
    return sorted(set(cpus))


def _read_topology(cpus: list[int]) -> dict[int, tuple[int, int, int]]:
    """cpu -> (NUMA node, package, core id), from sysfs (missing files: node 0, one core each)."""
    node_of: dict[int, int] = {}
    for node_dir in sorted(_SYS_NODE.glob("node[0-9]*")):
        try:
            for cpu in parse_cpu_list((node_dir / "cpulist").read_text()):
                node_of[cpu] = int(node_dir.name[4:])
        except (OSError, ValueError):
            continue
    topology = {}
    for cpu in cpus:
        base = _SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            package = int((base / "physical_package_id").read_text())
            core = int((base / "core_id").read_text())
        except (OSError, ValueError):
            package, core = 0, cpu
        topology[cpu] = (node_of.get(cpu, 0), package, core)
    return topology


def _auto_cpus(allowed: list[int], topology: dict[int, tuple[int, int, int]],
               reserved: int | None) -> tuple[list[int], int]:
    """One CPU per physical core on the first NUMA node with allowed CPUs, less `reserved`.

    Returns (cpus, number reserved).
    """
    first_node = min(topology[cpu][0] for cpu in allowed)
    per_core: dict[tuple[int, int], int] = {}
    for cpu in allowed:
        node, package, core = topology[cpu]
        if node == first_node:
            per_core.setdefault((package, core), cpu)  # the lowest sibling of each core
    cores = sorted(per_core.values())
    reserved = min(reserved or 0, len(cores) - 1)
    return cores[: len(cores) - reserved], reserved


def plan_cpu_threads(
    bind: str = "auto",
    reserved: int | None = None,
    allowed: list[int] | None = None,
    topology: dict[int, tuple[int, int, int]] | None = None,
    rank: int = 0,
) -> CpuThreadPlan:
    """The thread plan for `rank` (see the module doc); reads the process state by default.

    Args:
        bind: VLLM_CPU_OMP_THREADS_BIND's value: "auto", "nobind" or CPU lists.
        reserved: VLLM_CPU_NUM_OF_RESERVED_CPU's value (None: none reserved, the count
            adaptive under "auto").
        allowed: CPUs this process may run on (default: its affinity mask).
        topology: cpu -> (NUMA node, package, core id) (default: from sysfs).

    Raises:
        ValueError: `bind` is not a CPU list, has none for `rank` or names CPUs the
            process may not use; the message names the variable.
    """
    allowed = sorted(os.sched_getaffinity(0)) if allowed is None else sorted(allowed)
    if bind == "nobind":
        omp = os.environ.get("OMP_NUM_THREADS")
        source = f"OMP_NUM_THREADS={omp}" if omp else "torch's default"
        return CpuThreadPlan(None, None, f"VLLM_CPU_OMP_THREADS_BIND=nobind: thread count "
                                         f"from {source}, not bound")
    if bind == "auto":
        topology = _read_topology(allowed) if topology is None else topology
        adaptive = reserved is None and len(allowed) > 1
        cpus, reserved = _auto_cpus(allowed, topology, reserved)
        cores = len(cpus) + reserved
        why = f"VLLM_CPU_OMP_THREADS_BIND=auto: {cores} physical core(s) allowed, "
        if adaptive:
            why += ("computing on those other processes leave idle (measured every second; "
                    "VLLM_CPU_NUM_OF_RESERVED_CPU=N fixes a reserve instead)")
        else:
            why += (f"{reserved} reserved (VLLM_CPU_NUM_OF_RESERVED_CPU) for the server's "
                    "other threads")
        return CpuThreadPlan(len(cpus), tuple(cpus), why, adaptive=adaptive and len(cpus) > 1)
    lists = bind.split("|")
    if rank >= len(lists):
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} has {len(lists)} CPU list(s), "
                         f"none for rank {rank}")
    try:
        cpus = parse_cpu_list(lists[rank])
    except ValueError as e:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND: {e}, 'auto' or 'nobind'") from None
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} names CPU(s) {outside} this "
                         f"process may not use (allowed: {allowed})")
    return CpuThreadPlan(len(cpus), tuple(cpus), f"VLLM_CPU_OMP_THREADS_BIND={bind}")


def plan_cpu_threads_from_env(rank: int = 0) -> CpuThreadPlan:
    """`plan_cpu_threads` for this process: VLLM_CPU_OMP_THREADS_BIND and
    VLLM_CPU_NUM_OF_RESERVED_CPU from `envs`, its affinity mask, sysfs.

    Raises:
        ValueError: a malformed variable (naming it), as `plan_cpu_threads`.
    """
    return plan_cpu_threads(envs.VLLM_CPU_OMP_THREADS_BIND, envs.VLLM_CPU_NUM_OF_RESERVED_CPU,
                            rank=rank)


def check_cpu_threads_env() -> None:
    """Reject a malformed VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU early.

    Raises:
        ValueError: as `plan_cpu_threads_from_env`.
    """
    reserved = envs.VLLM_CPU_NUM_OF_RESERVED_CPU  # parsed (checked) here
    if envs.VLLM_CPU_OMP_THREADS_BIND not in ("auto", "nobind"):
        plan_cpu_threads(envs.VLLM_CPU_OMP_THREADS_BIND, reserved)


def apply_cpu_thread_plan(plan: CpuThreadPlan) -> CpuThreadGovernor | None:
    """Set torch's thread count and start its OpenMP team on the plan's CPUs.

    The calling thread's affinity is narrowed to the plan's CPUs while one
    parallel op starts the team (the new threads inherit the mask), then
    restored. A team that already exists keeps its threads' masks.

    Returns:
        for an adaptive plan, its governor, which has already set the count
        from a first 0.2 s reading; else None.
    """
    import torch

    if plan.num_threads is None:
        return None
    torch.set_num_threads(plan.num_threads)
    if plan.cpus is None or plan.num_threads < 2:
        return None
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, plan.cpus)
    try:
        torch.ones(1 << 20).add_(1)  # large enough to run in parallel: the team starts
    finally:
        os.sched_setaffinity(0, saved)
    if not plan.adaptive:
        return None
    try:
        governor = CpuThreadGovernor(plan.cpus)
    except OSError as e:  # no /proc/stat: the team's full size stays
        logger.warning("CPU threads: cannot read the cores' load (%s); computing on all %d",
                       e, plan.num_threads)
        return None
    time.sleep(_FIRST_READING_S)
    governor.adjust(force=True)
    return governor


_FIRST_READING_S = 0.2
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (proc(5), /proc/stat)


def read_busy_seconds(cpus: tuple[int, ...], proc_stat: str = "/proc/stat") -> float:
    """CPU seconds the given CPUs spent busy since boot, every process together.

    Busy is user + nice + system + irq + softirq + steal (time the hypervisor gave
    another guest counts: the core was not ours), in USER_HZ ticks converted to seconds.

    Raises:
        OSError: `proc_stat` cannot be read.
    """
    wanted = {f"cpu{cpu}" for cpu in cpus}
    ticks = 0
    with open(proc_stat) as f:
        for line in f:
            name, *fields = line.split()
            if name in wanted:
                ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuThreadGovernor:
    """Between steps: compute with the plan's cores that other processes leave idle.

    `adjust()` is cheap when not due (one clock read); at most once per `interval_s`
    it measures, over the time since the last reading,

        others = (busy seconds of the plan's CPUs - this process's CPU seconds) / wall seconds
        threads = max(1, len(cpus) - ceil(others - tolerance))

    and calls torch.set_num_threads (the OpenMP team keeps its threads and their
    masks; a smaller count leaves the rest asleep). `tolerance` (0.2 cores) lets a
    server's own frontend and a shell's odd command pass without costing a core.

    Args:
        cpus: the plan's CPUs (the team's size is their number).
        interval_s: seconds between readings.
        busy: reads the CPUs' busy seconds (default: /proc/stat).
        own: this process's CPU seconds (default: os.times, every thread).
        clock: wall seconds (default: time.monotonic).
    """

    def __init__(self, cpus: tuple[int, ...], interval_s: float = 1.0, tolerance: float = 0.2,
                 busy: Callable[[], float] | None = None, own: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpus = cpus
        self.interval_s = interval_s
        self.tolerance = tolerance
        self._busy = busy or (lambda: read_busy_seconds(cpus))
        self._own = own or (lambda: sum(os.times()[:2]))
        self._clock = clock
        self._last = (clock(), self._busy(), self._own())
        self.num_threads = len(cpus)
        self.others_cores = 0.0  # the last reading

    def adjust(self, force: bool = False) -> int:
        """Re-read the load if `interval_s` passed (or `force`); returns the thread count."""
        now = self._clock()
        if not force and now - self._last[0] < self.interval_s:
            return self.num_threads
        busy, own = self._busy(), self._own()
        wall = max(now - self._last[0], 1e-6)
        self.others_cores = max(0.0, (busy - self._last[1]) - (own - self._last[2])) / wall
        self._last = (now, busy, own)
        taken = max(0, math.ceil(self.others_cores - self.tolerance))
        threads = max(1, len(self.cpus) - taken)
        if threads != self.num_threads:
            import torch

            torch.set_num_threads(threads)
            logger.debug("CPU threads: %d -> %d (other processes kept %.2f core(s) busy)",
                         self.num_threads, threads, self.others_cores)
            self.num_threads = threads
        return threads
