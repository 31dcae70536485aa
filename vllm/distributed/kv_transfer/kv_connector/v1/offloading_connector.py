"""`OffloadingConnector`: vLLM's CPU offload of KV blocks, over this engine's KV cache.

    step N     a request's block b becomes full -> after the forward, its bytes
               are copied to a host slot; the slot is keyed by the block's hash
    later      b was evicted from the device cache; a request with the same
               prefix misses the prefix cache, finds the hash on the host, and
               gets the bytes copied back into its new block before the forward
               (those tokens are not computed again)

    scheduler side (torch-free)               worker side
    host index: hash -> slot (LRU)            host copy per layer:
    loads / stores per step  --metadata-->    [num_cpu_blocks, 2, block_size, heads, head_size]

Host capacity: `kv_connector_extra_config.num_cpu_blocks`, or
`cpu_bytes_to_use // bytes per block` (all layers); the worker side decides
and reports it through `get_handshake_metadata`, since only it knows the
block's bytes.

Sleep mode: the host index is emptied at sleep, like the prefix cache, so a
woken engine never loads KV computed before it slept.

Order inside one step: loads (`start_load_kv`) run before the forward and
stores (`wait_for_save`) after it, so a host slot evicted and reused by a
store in the same step is read by its load first. A slot receives at most
one store per step: when the host holds fewer blocks than one step stores,
the rest waits for a later step.

Which blocks load: a request's blocks are its prefix-cache hit, then new
blocks. The host serves whole blocks right after the hit (the hit that
`get_num_new_matched_tokens` was given: the request's num_computed_tokens is
still 0 at `update_state_after_alloc`), short of the block holding the last
token, which is computed; so every token counted as loaded is written by a load.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import update_request_block_hashes

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    loads: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)


@dataclass
class _TrackedRequest:
    request: Request
    blocks: list[KVCacheBlock]  # the KV cache manager's live list for the request
    num_stored_blocks: int = 0  # leading full blocks already on the host (or found there)


class OffloadingConnector(KVConnectorBase_V1):
    """CPU offload: full blocks copied to host memory, loaded back on a later prefix miss."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self.extra = self.kv_transfer_config.kv_connector_extra_config
        self.num_cpu_blocks = 0
        # scheduler side
        self.host_index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self.free_slots: list[int] = []
        self.tracked: dict[str, _TrackedRequest] = {}
        # req id -> its local prefix-cache hit (tokens), from the last
        # get_num_new_matched_tokens, until update_state_after_alloc
        self.local_hits: dict[str, int] = {}
        self.stored_slots: set[int] = set()  # slots that this step's stores write
        self.meta = OffloadingConnectorMetadata()
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.host_caches: dict[str, torch.Tensor] = {}
        self.registered_regions: list[tuple[int, int]] = []

    # ------------------------------------------------------------ worker side
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]
    ) -> None:
        """Allocate the host copy: one [num_cpu_blocks, *block shape] tensor per layer.

        Raises:
            ValueError: cpu_bytes_to_use is smaller than one block of all layers.
        """
        import torch

        self.kv_caches = dict(kv_caches)
        self.registered_regions = list(regions)
        bytes_per_block = sum(v[0].nbytes for v in kv_caches.values())
        n = self.extra.get("num_cpu_blocks") or self.extra["cpu_bytes_to_use"] // bytes_per_block
        if n < 1:
            raise ValueError(
                f"cpu_bytes_to_use={self.extra['cpu_bytes_to_use']} holds no KV block: one "
                f"block of all layers is {bytes_per_block} bytes"
            )
        self.num_cpu_blocks = n
        pin = torch.cuda.is_available()
        self.host_caches = {
            name: torch.empty((n, *v.shape[1:]), dtype=v.dtype, pin_memory=pin)
            for name, v in kv_caches.items()
        }
        logger.info("CPU offload: %d host blocks (%.1f MiB)", n, n * bytes_per_block / 2**20)

    def get_handshake_metadata(self) -> dict[str, Any]:
        return {"num_cpu_blocks": self.num_cpu_blocks}

    def sleep(self) -> None:
        """Scheduler side: the host copies are forgotten, as the prefix cache is (the
        weights may change before the engine serves again: RL loops update them
        while it sleeps). The worker side keeps its host buffers for the wake."""
        if self.role == KVConnectorRole.SCHEDULER:
            self.host_index.clear()
            self.free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))
            self.tracked.clear()
            self.local_hits.clear()
            self.stored_slots = set()
            self.meta = OffloadingConnectorMetadata()

    def wake_up(self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]) -> None:
        """The same views over fresh pages: copy between them and the host from now on."""
        self.kv_caches = dict(kv_caches)
        self.registered_regions = list(regions)

    def start_load_kv(self, **kwargs: Any) -> None:
        """Copy the planned host slots into their device blocks (synchronous)."""
        loads = self._get_connector_metadata().loads
        if loads:
            self._copy(loads, to_device=True)

    def wait_for_save(self) -> None:
        """Copy this step's newly full blocks to their host slots (after the forward)."""
        stores = self._get_connector_metadata().stores
        if stores:
            self._copy(stores, to_device=False)

    def _copy(self, pairs: list[tuple[int, int]], to_device: bool) -> None:
        import torch

        device_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        slots = torch.tensor([s for _, s in pairs], dtype=torch.long)
        for name, view in self.kv_caches.items():
            host = self.host_caches[name]
            if to_device:
                view[device_ids.to(view.device)] = host[slots].to(view.device, non_blocking=True)
            else:
                host[slots] = view[device_ids.to(view.device)].to("cpu")
        if to_device and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    # --------------------------------------------------------- scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[str, Any]) -> None:
        """The worker side's host capacity (blocks); again after a wake, with the same."""
        if metadata["num_cpu_blocks"] == self.num_cpu_blocks:
            return  # after a wake: the slots in use stay in use
        self.num_cpu_blocks = metadata["num_cpu_blocks"]
        self.free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Full blocks after the local hit whose hashes are on the host, in tokens.

        Whole blocks only, and never the block holding the last token (it is
        computed, for the next logits): the scheduler caps the answer at
        `num_tokens - 1`, and a cap inside a block would count tokens as
        loaded that no load writes. The hit is remembered for
        `update_state_after_alloc`, which places the loads after it.
        """
        hashes = update_request_block_hashes(request, self.block_size)
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # blocks wholly before the last token
        count = 0
        for block_hash in hashes[first:last]:
            if block_hash not in self.host_index:
                break
            count += 1
        self.local_hits[request.request_id] = num_computed_tokens
        return count * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """Plan loads into the blocks after the local hit (`blocks` starts with the hit's
        blocks; `request.num_computed_tokens` is not yet set to the hit, so the hit
        comes from `get_num_new_matched_tokens`)."""
        num_hit_tokens = self.local_hits.pop(request.request_id, 0)
        if num_external_tokens % self.block_size:
            raise ValueError(
                f"request {request.request_id!r}: {num_external_tokens} external tokens are "
                f"not whole blocks of {self.block_size}"
            )
        first = num_hit_tokens // self.block_size
        hashes = request.block_hashes
        for i in range(first, first + num_external_tokens // self.block_size):
            slot = self.host_index[hashes[i]]
            self.host_index.move_to_end(hashes[i])
            self.meta.loads.append((blocks[i].block_id, slot))
        self.tracked[request.request_id] = _TrackedRequest(request, blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Plan stores for the blocks that this step's tokens make full; hand over the plan."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.tracked.pop(req_id, None)
        for req_id in scheduler_output.num_scheduled_tokens:
            tracked = self.tracked.get(req_id)
            if tracked is not None:
                self._plan_stores(tracked)
        meta, self.meta = self.meta, OffloadingConnectorMetadata()
        self.stored_slots = set()
        return meta

    def _plan_stores(self, tracked: _TrackedRequest) -> None:
        request = tracked.request  # num_computed_tokens already counts this step
        hashes = update_request_block_hashes(request, self.block_size)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for i in range(tracked.num_stored_blocks, num_full):
            if hashes[i] in self.host_index:
                self.host_index.move_to_end(hashes[i])
                continue
            slot = self._take_slot()
            if slot is None:
                num_full = i  # the rest is tried again next step (the blocks stay the request's)
                break
            self.host_index[hashes[i]] = slot
            self.meta.stores.append((tracked.blocks[i].block_id, slot))
            self.stored_slots.add(slot)
        tracked.num_stored_blocks = max(tracked.num_stored_blocks, num_full)

    def _take_slot(self) -> int | None:
        """A free host slot, else the least recently used one; None when that one already
        receives a store this step (the host copy is smaller than one step's stores:
        two copies into one slot in one step would leave either block there)."""
        if self.free_slots:
            return self.free_slots.pop()
        if not self.host_index:
            return None
        block_hash, slot = next(iter(self.host_index.items()))  # least recently used
        if slot in self.stored_slots:
            return None
        del self.host_index[block_hash]
        return slot

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.tracked.pop(request.request_id, None)
        self.local_hits.pop(request.request_id, None)
        return False, None
