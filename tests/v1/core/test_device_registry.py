"""The per-device registry of elastic engines and the demand protocol, on a real
shared-memory file, with real processes (torch-free)."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from vllm.v1.core.device_registry import NUM_SLOTS, DeviceKVRegistry, EngineSlot, registered_devices
from vllm.v1.core.elastic_sharing import (
    DEMAND_RENEW_S,
    DeviceShare,
    DeviceSharing,
    preempt_floor,
)

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_slots_round_trip_and_readers_see_only_live_engines(tmp_path):
    a = DeviceKVRegistry("GPU-uuid-1", tmp_path)
    assert registered_devices(tmp_path) == ["GPU-uuid-1"]
    a.register("model-a")
    a.update(committed=64 * MiB, in_use=8 * MiB, reclaimable=32 * MiB, limit=1 << 30)
    reader = DeviceKVRegistry("GPU-uuid-1", tmp_path)  # kv-top's view: no slot of its own
    (slot,) = reader.engines()
    assert (slot.name, slot.pid, slot.committed, slot.in_use, slot.reclaimable) == (
        "model-a", os.getpid(), 64 * MiB, 8 * MiB, 32 * MiB)
    a.close()
    assert reader.engines() == []  # shut down: the slot is empty
    reader.close()


def _register_and_hang(directory, ready):
    registry = DeviceKVRegistry("dev", directory)
    registry.register("doomed")
    registry.update(committed=5 * MiB)
    ready.set()
    signal.pause()


def test_an_engine_killed_with_sigkill_leaves_nothing_stale(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_register_and_hang, args=(str(tmp_path), ready))
    child.start()
    try:
        assert ready.wait(60)
        reader = DeviceKVRegistry("dev", tmp_path)
        assert [s.name for s in reader.engines()] == ["doomed"]
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert reader.engines() == []  # its slot is ignored ...
        me = DeviceKVRegistry("dev", tmp_path)
        me.register("next")
        assert me.slot_index == 0  # ... and reused
        assert [s.name for s in reader.engines()] == ["next"]
    finally:
        if child.is_alive():
            child.kill()


def test_a_reused_pid_does_not_keep_a_dead_engines_slot():
    ticks = EngineSlot(pid=os.getpid(), start_ticks=1).is_alive()  # other start time
    assert not ticks
    assert EngineSlot(pid=os.getpid(), start_ticks=_own_ticks()).is_alive()


def _own_ticks() -> int:
    from vllm.v1.core.device_registry import process_start_ticks
    return process_start_ticks(os.getpid())


def test_full_registry_and_bad_keys_are_refused(tmp_path):
    held = []
    for i in range(NUM_SLOTS):
        r = DeviceKVRegistry("dev", tmp_path)
        r.register(f"e{i}")
        held.append(r)
    with pytest.raises(RuntimeError, match="slots hold live engines"):
        DeviceKVRegistry("dev", tmp_path).register("one too many")
    with pytest.raises(ValueError, match="device key"):
        DeviceKVRegistry("../etc", tmp_path)
    for r in held:
        r.close()


def _sharing(tmp_path, name, clock, block_bytes=MiB):
    return DeviceSharing([DeviceShare("dev", block_bytes)], name, str(tmp_path), clock=clock)


def test_a_demand_is_covered_once_even_with_two_givers(tmp_path):
    clock = Clock()
    asker, giver1, giver2 = (_sharing(tmp_path, n, clock) for n in ("asker", "g1", "g2"))
    asker.want(50)  # 50 blocks of 1 MiB
    asked = []

    def give(n):
        def release_for(blocks, keep):
            asked.append(blocks)
            return min(blocks, n)
        return release_for

    assert giver1.answer(give(30))  # gives 30 of the 50
    assert giver2.answer(give(100))  # is asked only for the 20 still lacking
    assert asked == [50, 20]
    assert not giver1.answer(give(30)) and not giver2.answer(give(100))  # covered
    assert (giver1.num_reclaims, giver2.num_reclaims) == (1, 1)
    # Still short a second later (the memory went elsewhere): the demand is renewed.
    clock.now += DEMAND_RENEW_S
    asker.want(50)
    assert giver1.answer(give(30)) and asked[-1] == 50
    # Met: no demand, nothing to answer.
    asker.want(0)
    assert not giver2.answer(give(100))
    for s in (asker, giver1, giver2):
        s.close()


def test_a_giver_with_nothing_to_release_records_nothing(tmp_path):
    clock = Clock()
    asker, busy, idle = (_sharing(tmp_path, n, clock) for n in ("asker", "busy", "idle"))
    asker.want(8)
    assert not busy.answer(lambda blocks, keep: 0)
    assert idle.answer(lambda blocks, keep: blocks)  # the whole demand is still open to it
    for s in (asker, busy, idle):
        s.close()


def test_figures_are_written_in_bytes_per_device(tmp_path):
    s = _sharing(tmp_path, "m", Clock(), block_bytes=3 * MiB)
    s.publish(committed=10, in_use=4, reclaimable=5, floor=2, limit=40)
    (slot,) = DeviceKVRegistry("dev", tmp_path).engines()
    assert (slot.committed, slot.in_use, slot.reclaimable, slot.floor, slot.limit) == (
        30 * MiB, 12 * MiB, 15 * MiB, 6 * MiB, 120 * MiB)
    s.close()


def test_preemption_floor_is_the_fair_share_and_never_below_the_asker():
    def slot(committed, in_use=0, wanted=0):
        return EngineSlot(pid=1, committed=committed, in_use=in_use, wanted=wanted)

    big, small, idle = slot(80, in_use=70), slot(10, in_use=10, wanted=30), slot(10)
    engines = [big, small, idle]
    # 100 committed over the two busy engines: 50 each (the idle one counts for nothing).
    assert preempt_floor(big, small, engines) == 50
    # Three busy engines: the midpoint (45) is above the share (33).
    busy = slot(10, in_use=5)
    assert preempt_floor(big, small, [big, small, busy]) == 45
    # An asker holding as much: no preemption for it.
    assert preempt_floor(small, slot(10, wanted=5), engines) is None


def test_a_long_name_keeps_its_end_in_whole_characters():
    """A name over 48 bytes of UTF-8 keeps its last whole characters: cut at byte 48 from
    the end, "é" x 30 + "a" began with half an "é", which kv-top showed as U+FFFD."""
    for name in ("é" * 30 + "a", "x" * 60, "模型" * 10 + "abc"):
        kept = EngineSlot.unpack(EngineSlot(pid=1, start_ticks=1, name=name).pack()).name
        assert "\ufffd" not in kept and name.endswith(kept), kept
        assert 48 - 3 <= len(kept.encode()) <= 48  # at most a character's tail dropped
    assert EngineSlot.unpack(EngineSlot(pid=1, start_ticks=1, name="é" * 30 + "a").pack()).name \
        == "é" * 23 + "a"
