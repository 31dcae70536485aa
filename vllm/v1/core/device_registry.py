"""Elastic engines on one device know of each other: a registry in shared memory.

One file per device (`<VLLM_KV_REGISTRY_DIR>/vllm-kv-<device key>`, the key
a GPU's UUID, "host" on the CPU), mapped by every elastic engine that uses
the device and by `vllm kv-top`. Nothing to configure. The file is a header
and `NUM_SLOTS` fixed slots; an engine claims one at start-up and is the only
writer of its slot; every read and write holds `fcntl.lockf` on the file
(microseconds), so a reader never sees half a slot.

A slot (`EngineSlot`) says, in bytes of this device: what the engine's KV
cache has committed, what its requests use, what it could release now
without preempting (`reclaimable`: whole pieces above its floor, less what
its requests use and its low-water mark: blocks in use are moved below), its
floor and limit, and an unmet
demand (`wanted`: it tried to grow and the memory was not free) with a
sequence number that changes with each new demand. Engines that see a peer's
demand release reclaimable blocks between their steps (the demand protocol
is `ElasticKVPolicy`'s / the engine core's; this module only stores) and
record what they gave (`gave_to`, `gave_seq`, `gave_bytes`), so two givers
do not both answer the same demand in full (see elastic_sharing.py).

An engine that dies leaves nothing stale: a slot whose process is gone (or
whose pid now belongs to another process: the start time in /proc differs)
counts as empty for every reader, and the next claim reuses it.

Source: kvcached (github.com/ovg-project/kvcached) keeps a per-device shared
memory segment of each engine's KV usage for its `kvtop`; the layout,
demand and release fields here are ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

from vllm import envs

MAGIC = b"VLLMKVR2"  # 2: `engine_id` (2026-12-07)
NUM_SLOTS = 64
NAME_BYTES = 48
# pid, start ticks, name, committed, in_use, reclaimable, floor, limit, wanted,
# demand_seq, gave_to, gave_seq, gave_bytes, reclaims, updated (unix s), engine_id
_SLOT = struct.Struct(f"<qq{NAME_BYTES}s" + "q" * 11 + "dq")
_HEADER = struct.Struct("<8sqq")  # magic, slot size, number of slots
FILE_PREFIX = "vllm-kv-"
# What to do about a registry file that is there but cannot be used.
_FILE_HINT = "remove the file or set VLLM_KV_REGISTRY_DIR"
# ... and about a registry directory that cannot hold one.
_DIR_HINT = ("set VLLM_KV_REGISTRY_DIR to a directory this user can write, or unset it "
             "(default /dev/shm)")


class RegistryError(OSError):
    """A registry that cannot be joined: `str()` says why (naming the path), `hint` what
    the user can do about it (which differs for a missing directory and a foreign file)."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def default_registry_dir() -> Path:
    """`VLLM_KV_REGISTRY_DIR`, else /dev/shm where it exists, else the temp dir."""
    configured = envs.VLLM_KV_REGISTRY_DIR
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def directory_problem(path: Path | str, writable: bool = False) -> str | None:
    """Why `path` cannot hold registries ("does not exist", "is not a directory", "is not
    readable", "is not writable", or the system's reason), None when it can: read with
    `writable=False` (`vllm kv-top`), also written with `writable=True` (an engine)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISDIR(mode):
        return "is not a directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return "is not readable"
    if writable and not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22);
    None when the process does not exist, 0 where /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None if not _pid_exists(pid) else 0
    except OSError:
        return 0
    # The command name (field 2) is in parentheses and may hold spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # overflow: foreign bytes, no process
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class EngineSlot:
    """One engine's figures on one device. Byte counts; `updated` in unix seconds.

    Attributes:
        pid, start_ticks: the engine core process (start_ticks tells a reused pid).
        name: what `kv-top` shows (the served model name), its last 48 bytes of UTF-8.
        committed: KV cache bytes committed on this device.
        in_use: bytes of blocks that requests hold.
        reclaimable: bytes the engine could release now without preempting
            (whole pieces above its floor beyond what its requests use and its
            low-water mark; blocks in use above a piece are moved below it).
        floor, limit: the least and the most it holds.
        wanted: an unmet demand (0: none): bytes it tried to commit and could not.
        demand_seq: changes with each new demand.
        gave_to, gave_seq, gave_bytes: the last demand this engine answered
            (the asker's slot index + 1 and demand_seq) and the bytes it
            released for it.
        reclaims: demands answered, cumulative.
        updated: when the slot was last written.
        engine_id: the engine's id, the same in the registry of every device its
            ranks use (`vllm kv-top` adds an engine's entries up by it; a pid does
            not tell two engines of one process apart); 0: none given.
    """

    pid: int = 0
    start_ticks: int = 0
    name: str = ""
    committed: int = 0
    in_use: int = 0
    reclaimable: int = 0
    floor: int = 0
    limit: int = 0
    wanted: int = 0
    demand_seq: int = 0
    gave_to: int = 0
    gave_seq: int = 0
    gave_bytes: int = 0
    reclaims: int = 0
    updated: float = 0.0
    engine_id: int = 0

    def pack(self) -> bytes:
        values = [getattr(self, f.name) for f in fields(self)]
        name = self.name.encode()[-NAME_BYTES:]  # a long name keeps its end
        values[2] = name.lstrip(bytes(range(0x80, 0xC0)))  # no half character (kv-top: "\ufffd")
        return _SLOT.pack(*values)

    @classmethod
    def unpack(cls, data: bytes) -> EngineSlot:
        values = list(_SLOT.unpack(data))
        values[2] = values[2].rstrip(b"\0").decode(errors="replace")
        return cls(*values)

    def is_alive(self) -> bool:
        """The process that wrote the slot still runs (a reused pid does not count)."""
        if self.pid <= 0:
            return False
        ticks = process_start_ticks(self.pid)
        return ticks is not None and (ticks == self.start_ticks or not ticks)


class DeviceKVRegistry:
    """The registry file of one device, mapped; claim a slot with `register`.

    Args:
        device_key: the device's UUID ("host" for the CPU); [A-Za-z0-9._-] only.
        directory: where the file lives (default `default_registry_dir()`).

    Raises:
        ValueError: a key with other characters.
        RegistryError: the directory is missing or not writable, or the file cannot be
            opened, is not a registry of this version, or cannot be mapped.
    """

    def __init__(self, device_key: str, directory: Path | str | None = None) -> None:
        if not device_key or not all(c.isalnum() or c in "._-" for c in device_key):
            raise ValueError(f"device key {device_key!r}: use letters, digits, '.', '_', '-'")
        self.device_key = device_key
        self.path = Path(directory or default_registry_dir()) / f"{FILE_PREFIX}{device_key}"
        size = _HEADER.size + NUM_SLOTS * _SLOT.size
        fd = _open(self.path)
        try:
            with _locked(fd, exclusive=True):
                # Only a new (empty) file is made a registry: a short one is not ours (it
                # was overwritten, kv-top's reading included, until 2026-12-07).
                found = os.fstat(fd).st_size
                if found == 0:
                    os.ftruncate(fd, size)
                    os.pwrite(fd, _HEADER.pack(MAGIC, _SLOT.size, NUM_SLOTS), 0)
                header = os.pread(fd, _HEADER.size, 0) if found in (0, size) else b""
            if len(header) != _HEADER.size or _HEADER.unpack(header) != (
                    MAGIC, _SLOT.size, NUM_SLOTS):
                raise RegistryError(f"{self.path} is not a KV registry of this version",
                                    _FILE_HINT)
            self._map = mmap.mmap(fd, size)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError) and not isinstance(e, RegistryError):  # e.g. ENOSPC
                raise RegistryError(f"{self.path}: {e.strerror or e}", _FILE_HINT) from e
            raise
        self._fd = fd
        self.slot_index: int | None = None

    # ------------------------------------------------------------- reading
    def engines(self) -> list[EngineSlot]:
        """Every live engine's slot (dead ones left out), in slot order."""
        with _locked(self._fd, exclusive=False):
            slots = [self._read(i) for i in range(NUM_SLOTS)]
        return [s for s in slots if s.pid and s.is_alive()]

    def own_slot(self) -> EngineSlot:
        """This engine's slot as stored.

        Raises:
            RuntimeError: not registered.
        """
        index = self._own()
        with _locked(self._fd, exclusive=False):
            return self._read(index)

    # ------------------------------------------------------------- writing
    def register(self, name: str, engine_id: int | None = None) -> EngineSlot:
        """Claim a slot for this process (an empty one, or one whose process died);
        `engine_id`: the engine's, the same in each device's registry it joins (None:
        a new one, `new_engine_id()`).

        Raises:
            RuntimeError: registered already, or all `NUM_SLOTS` slots hold live engines.
        """
        if self.slot_index is not None:
            raise RuntimeError("this registry handle holds a slot already")
        slot = EngineSlot(pid=os.getpid(), start_ticks=process_start_ticks(os.getpid()) or 0,
                          name=name, updated=time.time(),
                          engine_id=new_engine_id() if engine_id is None else engine_id)
        with _locked(self._fd, exclusive=True):
            for i in range(NUM_SLOTS):
                held = self._read(i)
                if not held.pid or not held.is_alive():
                    self._write(i, slot)
                    self.slot_index = i
                    return slot
        raise RuntimeError(f"{self.path}: all {NUM_SLOTS} slots hold live engines")

    def update(self, **values: int | float) -> EngineSlot:
        """Write fields of this engine's slot (and `updated`); returns the slot written."""
        index = self._own()
        with _locked(self._fd, exclusive=True):
            slot = replace(self._read(index), updated=time.time(), **values)
            self._write(index, slot)
        return slot

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tuple[EngineSlot, list[tuple[int, EngineSlot]]]]:
        """Hold the file's lock exclusively: yields (this slot, [(slot index, live peer)]);
        write this slot with `put` inside.

        For read-decide-write steps that two engines must not interleave (two
        givers answering one demand).
        """
        index = self._own()
        with _locked(self._fd, exclusive=True):
            slots = [(i, self._read(i)) for i in range(NUM_SLOTS)]
            peers = [(i, s) for i, s in slots if i != index and s.pid and s.is_alive()]
            yield slots[index][1], peers

    def put(self, slot: EngineSlot) -> None:
        """Write this engine's slot; only inside `transaction()` (the lock is held)."""
        self._write(self._own(), replace(slot, updated=time.time()))

    def unregister(self) -> None:
        """Empty this engine's slot (at shutdown); a no-op when it holds none."""
        if self.slot_index is None:
            return
        with _locked(self._fd, exclusive=True):
            self._write(self.slot_index, EngineSlot())
        self.slot_index = None

    def close(self) -> None:
        """Unregister, unmap and close the file (it stays for the other engines)."""
        if self._fd < 0:
            return
        self.unregister()
        self._map.close()
        os.close(self._fd)
        self._fd = -1

    # ------------------------------------------------------------- internals
    def _own(self) -> int:
        if self.slot_index is None:
            raise RuntimeError("register() first")
        return self.slot_index

    def _read(self, index: int) -> EngineSlot:
        start = _HEADER.size + index * _SLOT.size
        return EngineSlot.unpack(self._map[start:start + _SLOT.size])

    def _write(self, index: int, slot: EngineSlot) -> None:
        start = _HEADER.size + index * _SLOT.size
        self._map[start:start + _SLOT.size] = slot.pack()


def _open(path: Path) -> int:
    """Open (or create) a registry file read-write; its directory's problem, if it has one,
    is the error (a missing VLLM_KV_REGISTRY_DIR read "remove the file" before).

    Raises:
        RegistryError: naming the directory or the file, with what to do.
    """
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        problem = directory_problem(path.parent, writable=True)
        if problem is not None:
            raise RegistryError(f"KV registry directory {path.parent} {problem}",
                                _DIR_HINT) from e
        raise RegistryError(f"{path}: {e.strerror or e}", _FILE_HINT) from e


def new_engine_id() -> int:
    """A random id for an engine's slots, > 0 (0: a slot of no engine)."""
    return secrets.randbits(62) + 1


def registered_devices(directory: Path | str | None = None) -> list[str]:
    """The device keys that have a registry file in `directory`, sorted."""
    root = Path(directory or default_registry_dir())
    return sorted(p.name[len(FILE_PREFIX):] for p in root.glob(f"{FILE_PREFIX}*")
                  if p.is_file())


@contextlib.contextmanager
def _locked(fd: int, exclusive: bool) -> Iterator[None]:
    fcntl.lockf(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)
