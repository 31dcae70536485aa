"""Reclaim on demand: elastic engines on one device give each other memory at once.

Torch-free; the engine core's `ElasticKVController` owns one `DeviceSharing`
(with the elastic cache on and `VLLM_ELASTIC_KV_SHARING` not 0). Between
steps, and at every idle poll:

    publish  this engine's committed / in-use / reclaimable / floor / limit
             blocks go to the registry of each device its ranks use (bytes:
             blocks x the rank's bytes per block), when they change
    want     an engine whose policy wants to grow and whose workers could
             not (the memory is not free) publishes the blocks it still
             lacks as a demand; a new, larger or renewed demand (unmet for
             `DEMAND_RENEW_S`) gets a new sequence number; met: 0
    answer   an engine that sees a peer's demand not yet covered by what
             others released for it (`gave_*` fields, read and written under
             the registry's lock, so two givers never both cover it in full)
             releases reclaimable blocks now (whole pieces, the blocks in use
             above them moved below, keeping its own low-water mark; the policy's
             `reclaim_target`), and records what it gave; an engine that
             holds more than the asker may also preempt requests to release
             more, down to `keep`: max(its fair share, the midpoint of the
             two), so the asker never ends above it and the two never
             preempt back and forth

The asker's next growth attempt (its next step) finds the memory free. The
timed idle release (`VLLM_ELASTIC_KV_SHRINK_DELAY_S`) stays as the fallback
for memory nobody asked for. Replaces: peers waiting for a timer while an
engine that no longer used 42 GiB gave it back in ~3 s steps (issue #49).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from vllm.logger import init_logger
from vllm.v1.core.device_registry import DeviceKVRegistry, EngineSlot, new_engine_id

logger = init_logger(__name__)

# An unmet demand that no release has met for this long is published again
# with a new sequence number, so peers that answered it look again (memory
# they released may have gone to a third process).
DEMAND_RENEW_S = 1.0


@dataclass(frozen=True)
class DeviceShare:
    """One device this engine uses: its key and the bytes one KV block takes there
    (summed over the engine's ranks on that device)."""

    key: str
    block_bytes: int


class DeviceSharing:
    """This engine's slot in the registry of each device it uses, and the demand protocol.

    Args:
        devices: the devices the engine's ranks use (one entry per device).
        name: what `vllm kv-top` shows (the served model name).
        directory: the registries' directory (default: `default_registry_dir()`).
        clock: seconds, monotonic (tests pass their own).

    Raises:
        RegistryError (an OSError): a registry cannot be joined (its directory or file
            named, with a hint that fits the cause).
        RuntimeError: a device's registry has no free slot.
    """

    def __init__(
        self, devices: list[DeviceShare], name: str, directory: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.devices = devices
        self.clock = clock
        self.registries: list[DeviceKVRegistry] = []
        # One id in every device's registry: `vllm kv-top` adds this engine's entries up.
        engine_id = new_engine_id()
        try:
            for device in devices:
                registry = DeviceKVRegistry(device.key, directory)
                self.registries.append(registry)
                registry.register(name, engine_id)
        except BaseException:
            self.close()
            raise
        self._wanted = 0  # blocks
        self._wanted_since = 0.0
        self.num_reclaims = 0  # demands this engine answered by releasing blocks

    def publish(self, *, committed: int, in_use: int, reclaimable: int, floor: int,
                limit: int) -> None:
        """Write this engine's figures (blocks) to every device's registry (the controller
        calls it when they changed)."""
        for device, registry in zip(self.devices, self.registries, strict=True):
            b = device.block_bytes
            registry.update(committed=committed * b, in_use=in_use * b,
                            reclaimable=reclaimable * b, floor=floor * b, limit=limit * b)

    def want(self, blocks: int) -> None:
        """Publish the blocks this engine lacks and could not commit (0: none)."""
        now = self.clock()
        renew = blocks and now - self._wanted_since >= DEMAND_RENEW_S
        if blocks == self._wanted and not renew:
            return
        new_demand = blocks > self._wanted or renew
        for device, registry in zip(self.devices, self.registries, strict=True):
            values: dict[str, int] = {"wanted": blocks * device.block_bytes}
            if new_demand:
                values["demand_seq"] = time.monotonic_ns()
            registry.update(**values)
        if new_demand:
            if not self._wanted or renew:  # one line per episode, not per larger demand
                logger.info("Elastic KV cache: %d blocks short; asking the device's engines",
                            blocks)
            self._wanted_since = now
        self._wanted = blocks

    def answer(self, release_for: Callable[[int], int]) -> bool:
        """Answer one peer's demand that others have not covered, if this engine can.

        Args:
            release_for: takes the blocks a peer still lacks (in this engine's
                blocks, rounded up) and `keep`, returns the blocks this engine
                will release for it now (0: none). `keep` (blocks) is the least
                this engine may keep if it preempts requests to release more:
                max(fair share, midpoint), see `preempt_floor`; None when the
                peer holds as much as this engine (no preemption for it).
                Called under the registry's lock: it only decides; the caller
                releases them after `answer` returns True.

        Returns:
            True when this engine promised blocks (recorded in its slot).
        """
        for device, registry in zip(self.devices, self.registries, strict=True):
            b = device.block_bytes
            with registry.transaction() as (me, peers):
                for index, peer in peers:
                    if not peer.wanted or (me.gave_to, me.gave_seq) == (index + 1,
                                                                          peer.demand_seq):
                        continue
                    covered = sum(
                        s.gave_bytes for s in [me] + [p for _, p in peers]
                        if (s.gave_to, s.gave_seq) == (index + 1, peer.demand_seq))
                    lacking = peer.wanted - covered
                    if lacking <= 0:
                        continue
                    keep = preempt_floor(me, peer, [me] + [p for _, p in peers])
                    blocks = release_for(-(-lacking // b), None if keep is None else -(-keep // b))
                    if blocks <= 0:
                        return False
                    registry.put(_gave(me, index + 1, peer.demand_seq, blocks * b))
                    self.num_reclaims += 1
                    logger.info("Elastic KV cache: releasing %d blocks (%.2f GiB) for %s "
                                "(pid %d), which lacks %.2f GiB", blocks, blocks * b / 2**30,
                                peer.name or "an engine", peer.pid, lacking / 2**30)
                    return True
        return False

    def close(self) -> None:
        """Leave every registry (this engine's slots are emptied)."""
        for registry in self.registries:
            registry.close()
        self.registries = []


def preempt_floor(me: EngineSlot, asker: EngineSlot, engines: list[EngineSlot]) -> int | None:
    """The fewest bytes `me` keeps when it preempts requests for `asker`, or None (it may not).

    max(fair share, midpoint): the fair share is the device's committed KV
    bytes over the engines that hold requests or ask (at least the two); the
    midpoint of the two engines' committed bytes keeps the asker from ending
    above `me` (it gets at most what `me` releases), so it never preempts
    back. None when `me` does not hold more than the asker.
    """
    if me.committed <= asker.committed:
        return None
    busy = sum(1 for s in engines if s.in_use or s.wanted)
    share = sum(s.committed for s in engines) // max(busy, 2)
    return max(share, (me.committed + asker.committed) // 2)


def _gave(me: EngineSlot, to: int, seq: int, nbytes: int) -> EngineSlot:
    return replace(me, gave_to=to, gave_seq=seq, gave_bytes=nbytes, reclaims=me.reclaims + 1)
