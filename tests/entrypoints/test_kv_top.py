"""`vllm kv-top`: the device registries as a table and as JSON (no engine, no torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from vllm.v1.core.device_registry import DeviceKVRegistry, EngineSlot

MiB, GiB = 1 << 20, 1 << 30


def _kv_top(tmp_path, *flags):
    return subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "kv-top", "--once",
         "--registry-dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=60)


def test_one_line_per_engine_and_a_device_total(tmp_path):
    a, b = DeviceKVRegistry("GPU-1234", tmp_path), DeviceKVRegistry("GPU-1234", tmp_path)
    a.register("Llama-3-8B")
    a.update(committed=40 * GiB, in_use=10 * GiB, reclaimable=24 * GiB, limit=60 * GiB)
    b.register("Qwen2.5-0.5B")
    b.update(committed=2 * GiB, in_use=2 * GiB, limit=30 * GiB, wanted=6 * GiB)
    try:
        out = _kv_top(tmp_path)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["DEVICE", "PID", "MODEL", "COMMITTED", "IN", "USE",
                                    "RECLAIMABLE", "LIMIT", "WANTED"]
        assert "Llama-3-8B" in lines[1] and "40.00 GiB" in lines[1] and "24.00 GiB" in lines[1]
        assert lines[1].rstrip().endswith("-")  # no unmet demand
        assert "Qwen2.5-0.5B" in lines[2] and lines[2].rstrip().endswith("6.00 GiB")
        assert "(2 engines)" in lines[3] and "42.00 GiB" in lines[3]

        snapshot = json.loads(_kv_top(tmp_path, "--json").stdout)
        (engines,) = snapshot["devices"].values()
        assert [e["name"] for e in engines] == ["Llama-3-8B", "Qwen2.5-0.5B"]
        assert engines[1]["wanted"] == 6 * GiB
    finally:
        a.close()
        b.close()
    assert _kv_top(tmp_path).stdout.strip() == "no elastic engine is running (none registered)"


def test_a_small_engine_reads_in_mib_not_zeros(tmp_path):
    """The bundled model's elastic engine holds 60 MiB: every column read "0.00 GiB"
    (in use 0.00 GiB of a cache of 0.06 GiB); below 1 GiB a figure is in MiB."""
    registry = DeviceKVRegistry("host", tmp_path)
    registry.register("engine-a")
    registry.update(committed=60 * MiB, in_use=1536 << 10, reclaimable=0, limit=GiB + GiB // 2)
    try:
        line = _kv_top(tmp_path).stdout.splitlines()[1]
        assert line.split()[2:] == ["engine-a", "60.00", "MiB", "1.50", "MiB", "0.00", "MiB",
                                    "1.50", "GiB", "-"]
    finally:
        registry.close()


@pytest.mark.parametrize("value", ["0", "abc", "nan", "inf", "1e308", "86401"])
def test_a_bad_interval_is_a_usage_error(tmp_path, value):
    out = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "kv-top", "--interval", value],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "> 0" in out.stderr and "_positive" not in out.stderr


def test_a_reader_that_stops_reading_ends_it_quietly(tmp_path):
    """`vllm kv-top --json | head -n 1` (or `| head` of the table): the pipe closes, and
    kv-top exits 0 without a BrokenPipeError traceback."""
    registry = DeviceKVRegistry("GPU-1234", tmp_path)
    registry.register("Llama-3-8B")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "kv-top", "--json",
             "--interval", "0.05", "--registry-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert "Llama-3-8B" in proc.stdout.readline()
        proc.stdout.close()  # the reader is gone: the next print meets a closed pipe
        assert proc.wait(timeout=60) == 0
        assert proc.stderr.read() == ""
    finally:
        registry.close()


def test_a_registry_of_another_version_is_named_and_skipped(tmp_path):
    """A file of another layout beside a good registry: kv-top shows the good one and
    names the other on stderr (it stopped with an OSError traceback), and leaves it as it
    was, also a short one (it was made a registry, kv-top's reading included); random
    bytes in a slot (a pid no process can have) count as no engine (OverflowError from
    os.kill)."""
    (tmp_path / "vllm-kv-GPU-old").write_bytes(b"NOTAKVR9" + bytes(20_000))
    (tmp_path / "vllm-kv-GPU-short").write_bytes(b"x")
    DeviceKVRegistry("GPU-junk", tmp_path).close()
    with open(tmp_path / "vllm-kv-GPU-junk", "r+b") as f:  # slot 0's pid: 2**63 - 1
        f.seek(24)
        f.write(b"\xff" * 7 + b"\x7f")
    registry = DeviceKVRegistry("GPU-1234", tmp_path)
    registry.register("Llama-3-8B")
    try:
        out = _kv_top(tmp_path)
        assert out.returncode == 0, out.stderr
        assert "Llama-3-8B" in out.stdout and "GPU-junk" not in out.stdout
        assert out.stderr.strip().splitlines() == [
            f"vllm kv-top: skipped: {tmp_path / name} is not a KV registry of this version"
            for name in ("vllm-kv-GPU-old", "vllm-kv-GPU-short")]
        assert (tmp_path / "vllm-kv-GPU-short").read_bytes() == b"x"
    finally:
        registry.close()


@pytest.mark.parametrize("make, problem", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text(""), "is not a directory"),
])
def test_a_registry_dir_that_is_not_a_directory_is_a_usage_error(tmp_path, make, problem):
    """`--registry-dir /nonexistent` (a typo) said "no elastic engine is running" and
    exited 0; now one line naming the path, exit 2, as a bad flag value. So does a
    VLLM_KV_REGISTRY_DIR naming one; an existing empty directory is still no engine."""
    path = tmp_path / "registry"
    make(path)
    out = _kv_top(path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"vllm kv-top: error: argument --registry-dir: {path} {problem} "
                          "(see vllm kv-top --help)\n")
    out = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "kv-top", "--once", "--json"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "VLLM_KV_REGISTRY_DIR": str(path)})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"vllm kv-top: error: VLLM_KV_REGISTRY_DIR: {path} {problem}\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _kv_top(empty)
    assert (out.returncode, out.stdout) == (0, "no elastic engine is running (none registered)\n")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_an_unreadable_registry_dir_is_a_usage_error(tmp_path):
    path = tmp_path / "registry"
    path.mkdir(mode=0o300)
    out = _kv_top(path)
    assert out.returncode == 2 and f"{path} is not readable" in out.stderr


def test_help_lists_the_json_fields():
    """`--json`'s fields are listed in `vllm kv-top --help` (they were documented nowhere):
    every field of an engine (the table's line) and of a registry's slot, each once, and
    the three keys of a snapshot."""
    from vllm.entrypoints.cli.kv_top import engines

    out = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "kv-top", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    epilog = out.stdout.split("--json: one object per snapshot", 1)[1]
    assert ('{"time": unix seconds, "engines": [ENGINE, ...], "devices": {DEVICE: [SLOT, ...]}}'
            in epilog)
    engine_part, slot_part = epilog.split("DEVICE is", 1)

    def listed(text: str) -> set[str]:  # the first column: "  pid, start_ticks   the ..."
        names = set()
        for line in text.splitlines():
            if line.startswith("  ") and line[2:3].isalpha():
                names.update(name.strip() for name in line.split("  ")[1].split(","))
        return names

    slot = {f.name: 0 for f in fields(EngineSlot)} | {"name": ""}
    assert listed(engine_part) == set(engines({"GPU-1": [slot]})[0])
    # A slot: the engine's fields but devices ("the fields above"), and its own.
    assert (listed(engine_part) - {"devices"}) | listed(slot_part) == set(slot)


def test_a_tensor_parallel_engine_is_one_line_of_its_totals(tmp_path):
    """TP=2 over two GPUs: the engine core writes its figures to each GPU's registry in that
    GPU's bytes (its rank's block there: SmolLM2's 2 + 1 KV heads make rank 0's 480 KiB
    and rank 1's 240 KiB). kv-top showed two lines, limit 90 and 45 MiB, for an engine
    whose limit (POST /kv_cache/limit, /metrics) is 135 MiB; it shows one line, the sums
    (the unit of the limit and /metrics), and a single engine of one GPU beside it."""
    from vllm.v1.core.elastic_sharing import DeviceShare, DeviceSharing

    tp2 = DeviceSharing([DeviceShare("GPU-aaaa", 480 << 10), DeviceShare("GPU-bbbb", 240 << 10)],
                        "Llama-TP2", directory=str(tmp_path))
    tp2.publish(committed=128, in_use=16, reclaimable=0, floor=128, limit=192)
    tp2.want(8)
    one = DeviceKVRegistry("GPU-aaaa", tmp_path)
    one.register("Qwen2.5-0.5B")
    one.update(committed=30 * MiB, limit=60 * MiB)
    try:
        out = _kv_top(tmp_path)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[1].split()[0] == "GPU-aaaa+1" and lines[1].split()[2:] == [
            "Llama-TP2", "90.00", "MiB", "11.25", "MiB", "0.00", "MiB", "135.00", "MiB",
            "5.62", "MiB"]
        assert lines[2].split()[0] == "GPU-aaaa" and "Qwen2.5-0.5B" in lines[2]
        assert len(lines) == 3  # two engines, not on the same devices: no total line

        snapshot = json.loads(_kv_top(tmp_path, "--json").stdout)
        engine = snapshot["engines"][0]
        assert engine["devices"] == ["GPU-aaaa", "GPU-bbbb"]
        assert (engine["committed"], engine["limit"], engine["wanted"]) == (
            128 * 720 << 10, 192 * 720 << 10, 8 * 720 << 10)
        # The registries as the engines read them: each GPU's part.
        assert [e["limit"] for e in snapshot["devices"]["GPU-bbbb"]] == [192 * 240 << 10]
    finally:
        tp2.close()
        one.close()
