"""`vllm kv-top`: the elastic KV caches of every engine on this machine's devices, live.

Reads the per-device registries (`vllm/v1/core/device_registry.py`) that
elastic engines (`--enable-elastic-kv-cache`) keep in shared memory; starts
no engine, touches no GPU, imports no torch. One line per engine: device(s),
pid, model, committed, in use, reclaimable, limit, and an unmet demand
(`WANTED`: it could not grow and asked the others). kvcached ships the same
view as `kvtop`.

An engine's line is its figures summed over the devices its ranks use, the
unit of its limit (`POST /kv_cache/limit`) and of /metrics: each device's
registry holds that device's part (what its peers there weigh a demand in),
so with tensor parallelism over two GPUs an engine has an entry in both
(before 2026-12-07 kv-top showed those entries, which did not add up to the
limit an operator had set). `--json` gives both: `engines` (the lines) and
`devices` (the registries as stored).

    vllm kv-top                 # refresh every second until Ctrl-C
    vllm kv-top --once --json   # one snapshot, machine-readable
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

MiB, GiB = 1 << 20, 1 << 30
_COLUMNS = ("DEVICE", "PID", "MODEL", "COMMITTED", "IN USE", "RECLAIMABLE", "LIMIT", "WANTED")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-top",
        help="Show the elastic KV cache of every engine on this machine's devices, live.",
        description="One line per elastic engine (--enable-elastic-kv-cache): committed, "
                    "in use, reclaimable and limit (GiB, MiB below 1 GiB), and what it "
                    "lacks when it could not grow, summed over the devices its ranks use "
                    "(DEVICE: the first, +N the others): the unit of its limit and "
                    "/metrics. Read from the engines' shared-memory registry.",
        usage="vllm kv-top [options]",
        epilog=JSON_FIELDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--interval", type=_positive, default=1.0,
                        help="Seconds between refreshes (default: %(default)s).")
    parser.add_argument("--once", action="store_true", help="Print one snapshot and exit.")
    parser.add_argument("--json", action="store_true",
                        help="JSON, one object per snapshot: the engines and the devices' "
                             "registries, bytes (the fields: below).")
    parser.add_argument("--registry-dir", type=_directory, default=None,
                        help="Where the registries are (default: VLLM_KV_REGISTRY_DIR, "
                             "else /dev/shm); an existing directory.")
    parser.set_defaults(dispatch=run)


# `vllm kv-top --help`'s epilog: what `--json` prints, field by field (a test checks that
# every field of an engine and every `EngineSlot` field is listed, and nothing else).
JSON_FIELDS = """\
--json: one object per snapshot, one line each:
  {"time": unix seconds, "engines": [ENGINE, ...], "devices": {DEVICE: [SLOT, ...]}}
ENGINE: one per live engine (the table's lines, in the order shown), its figures
summed over the devices its ranks use, the unit of its limit (POST /kv_cache/limit)
and of /metrics; byte counts in blocks' bytes (blocks x the bytes of one block over
all layers and ranks), so in_use <= committed <= limit:
  pid, start_ticks   the engine core process and its start time (clock ticks
                     since boot; tells a reused pid)
  engine_id          the same in each of its devices' registries (two engines
                     of one process have one pid)
  name               the served model name (its last 48 bytes)
  devices            the keys of the devices its ranks use
  committed          KV cache bytes committed
  in_use             bytes of the blocks its requests hold
  reclaimable        bytes it could release now without preempting
  floor, limit       the least and the most it holds
  wanted             bytes it tried to commit and could not (0: none)
  reclaims           demands it answered, in all
  updated            when the engine last wrote its figures (unix seconds)
DEVICE is the GPU's UUID ("host" on the CPU); each SLOT (one per live engine, in
slot order) is an engine's entry in that device's registry, as its peers read it:
the fields above but devices, in bytes of its ranks on that device only (with
tensor parallelism over several GPUs, a part of the engine's figure), and
  demand_seq         changes with each new demand
  gave_to, gave_seq  the last demand it answered: the asker's slot + 1 and its
                     demand_seq (0: none)
  gave_bytes         bytes it released for that demand"""

# An engine's figures that add up over its devices (the others are the engine's own).
_SUMMED = ("committed", "in_use", "reclaimable", "floor", "limit", "wanted", "reclaims")


_MAX_INTERVAL_S = 86400


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:  # argparse would name this function ("invalid _positive value")
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds > 0, got {text!r}") from None
    if not 0 < value <= _MAX_INTERVAL_S:  # inf or 1e308 overflowed time.sleep: a traceback
        raise argparse.ArgumentTypeError(
            f"must be > 0 and at most {_MAX_INTERVAL_S} (a day), got {text}")
    return value


def _directory(text: str) -> str:
    """`--registry-dir`: a directory that exists and can be read (a mistyped path read as
    "no elastic engine is running", exit 0)."""
    from vllm.v1.core.device_registry import directory_problem

    problem = directory_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return text


def snapshot(directory: str | None = None) -> dict[str, list[dict]]:
    """{device key: [each live engine's slot as a dict, bytes]} of every registry (a file
    that is not a registry of this version is named on stderr and left out)."""
    from vllm.v1.core.device_registry import DeviceKVRegistry, registered_devices

    devices: dict[str, list[dict]] = {}
    for key in registered_devices(directory):
        try:
            registry = DeviceKVRegistry(key, directory)
        except OSError as e:  # another version's file, or not ours: name it, show the rest
            print(f"vllm kv-top: skipped: {e}", file=sys.stderr)
            continue
        try:
            devices[key] = [asdict(slot) for slot in registry.engines()]
        finally:
            registry.close()
    return devices


def engines(devices: dict[str, list[dict]]) -> list[dict]:
    """One dict per live engine (`JSON_FIELDS`' ENGINE): an engine is its (pid,
    start_ticks, engine_id), in the registry of every device its ranks use; `_SUMMED`
    figures add up over those devices, `updated` is the latest. In order of first
    appearance (devices sorted, slots in order)."""
    found: dict[tuple[int, int, int], dict] = {}
    for key, slots in devices.items():
        for s in slots:
            e = found.setdefault((s["pid"], s["start_ticks"], s["engine_id"]), dict(
                pid=s["pid"], start_ticks=s["start_ticks"], engine_id=s["engine_id"],
                name=s["name"], devices=[], **dict.fromkeys(_SUMMED, 0), updated=0.0))
            e["devices"].append(key)
            for f in _SUMMED:
                e[f] += s[f]
            e["updated"] = max(e["updated"], s["updated"])
    return list(found.values())


def render(devices: dict[str, list[dict]]) -> str:
    """The table (`_size`: GiB, MiB below 1 GiB), a line per engine (`engines`), and a
    total line per set of devices that several engines use (one GPU each: per device)."""
    groups: dict[tuple[str, ...], list[dict]] = {}
    for e in engines(devices):
        groups.setdefault(tuple(e["devices"]), []).append(e)
    rows = [_COLUMNS]
    for keys, group in groups.items():
        where = keys[0][:12] + (f"+{len(keys) - 1}" if len(keys) > 1 else "")
        for e in group:
            rows.append((where, str(e["pid"]), e["name"][-32:], *(
                _size(e[f]) for f in ("committed", "in_use", "reclaimable", "limit")),
                _size(e["wanted"]) if e["wanted"] else "-"))
        if len(group) > 1:
            rows.append((where, "", f"({len(group)} engines)", *(
                _size(sum(e[f] for e in group))
                for f in ("committed", "in_use", "reclaimable")), "", ""))
    if len(rows) == 1:
        return "no elastic engine is running (none registered)"
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    left = {0, 2}
    return "\n".join(
        "  ".join(c.ljust(w) if i in left else c.rjust(w)
                  for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
        for r in rows)


def _size(nbytes: int) -> str:
    """Bytes as GiB, or as MiB below 1 GiB: a small engine's 60 MiB read "0.06 GiB" and its
    in-use blocks "0.00 GiB" (nvidia-smi and vLLM's start-up log read MiB and GiB)."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.2f} MiB"


def run(args: argparse.Namespace) -> int:
    """Print snapshots until Ctrl-C (one with --once); 2 when the registry directory that
    VLLM_KV_REGISTRY_DIR names cannot be read (`--registry-dir` is checked by argparse)."""
    from vllm import envs
    from vllm.v1.core.device_registry import directory_problem

    configured = envs.VLLM_KV_REGISTRY_DIR
    if args.registry_dir is None and configured:
        problem = directory_problem(configured)
        if problem is not None:
            print(f"vllm kv-top: error: VLLM_KV_REGISTRY_DIR: {configured} {problem}",
                  file=sys.stderr)
            return 2
    live = not args.once and sys.stdout.isatty() and not args.json
    try:
        while True:
            devices = snapshot(args.registry_dir)
            text = (json.dumps({"time": time.time(), "engines": engines(devices),
                                "devices": devices}) if args.json else render(devices))
            if live:
                sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: a refreshing screen
            print(text, flush=True)
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader left (`vllm kv-top | head`): end quietly, as `top` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
