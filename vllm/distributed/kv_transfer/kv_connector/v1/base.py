"""The KV connector API in vLLM V1's shape: one class, two roles, two processes.

    engine core process                        worker (one per rank; TP=1 today)
    -------------------                        ------------------------------------
    Scheduler                                  Worker.execute_model
      get_num_new_matched_tokens(req, n)         bind_connector_metadata(meta)
      update_state_after_alloc(req, blks, n)     start_load_kv()        before the forward
      build_connector_meta(sched_out) --meta-->  wait_for_layer_load(layer) (layerwise only)
      request_finished(req, block_ids)           save_kv_layer(layer, ...) (layerwise only)
        -> (delay_free, kv_transfer_params)      wait_for_save()        after the forward
      update_connector_output(out) <--------     get_finished(finished_req_ids)
                                   KVConnectorOutput (in ModelRunnerOutput)

The scheduler side never touches a tensor (this module imports no torch at
run time, so `v1/core` may hold a connector). The worker side is created only
after the KV cache has its final, committed size (`Worker.run_post_kv_cache_hooks`,
after `extend_kv_cache`), and registers exactly what `register_kv_caches`
documents below.

Loads come in two kinds, as in vLLM. Synchronous (`load_async` False from
`get_num_new_matched_tokens`, OffloadingConnector): `start_load_kv` finishes
its copies before returning and the request computes in the same step.
Asynchronous (`load_async` True, NixlConnector): the request gets its blocks
and waits in WAITING_FOR_REMOTE_KVS; `start_load_kv` only posts the transfer,
`get_finished` reports it in `finished_recving` a later step, and the request
is scheduled after that; no step waits for it. The layerwise hooks have
nothing to wait for and the runner does not call them (they stay part of the
API for layerwise connectors). A load that fails is reported in
`KVConnectorOutput.failed_recving`; the scheduler then finishes that request
with an error and frees its blocks before any of them is cached.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
]


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # in the engine core process, beside the scheduler
    WORKER = 1  # in the worker, beside the KV cache


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (picklable)."""


class KVConnectorBase_V1(ABC):
    """Base class of every KV connector; one instance per role and process.

    Class attributes (what the worker prepares before the connector exists):
        needs_one_allocation_per_segment: the worker defragments the KV cache
            (`KVCacheBuffers.defragment`) before `register_kv_caches`, because
            the transport cannot register or transfer a range that spans
            several physical allocations (UCX and `cuMemCreate`).
        reads_pages_from_other_processes: another process (a peer instance, a
            NIC) reads the KV pages, so the extensible cache creates them
            exportable (POSIX file descriptors, GPUDirect-RDMA capable where
            the driver allows; `VmmDriver.enable_transfer_flags`).

    Args:
        vllm_config: the engine's validated configuration (its
            `kv_transfer_config` names this connector).
        role: which side this instance is.
    """

    needs_one_allocation_per_segment = False
    reads_pages_from_other_processes = False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        self.vllm_config = vllm_config
        self.role = role
        self.kv_transfer_config = vllm_config.kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self._connector_metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------------ worker side
    @abstractmethod
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]
    ) -> None:
        """Take the final KV cache: per-layer views and the byte regions to register.

        The contract (DESIGN.md section 4, step 6):
        - called once, after `extend_kv_cache`: the views span only committed
          memory and will not change size while the connector lives;
        - `regions` come from the per-layer views (`KVCacheBuffers.committed_spans()`,
          derived from data pointers, shapes and strides); a view's
          `untyped_storage().nbytes()` is its own segment's committed prefix
          (never the reservation), but storages alone do not say which views
          are adjacent;
        - a fully backed allocation gives one region; a grown extensible cache
          one region per committed segment prefix (per layer when layers are
          outermost); a connector that registers memory (NIXL) registers
          exactly these (base, length) pairs, and nothing before this call.

        Args:
            kv_caches: layer name -> view [num_blocks, 2, block_size,
                num_kv_heads, head_size] over committed blocks.
            regions: the committed spans as (base address, length in bytes),
                sorted by address. Block b of a layer is
                `kv_caches[layer][b]` (contiguous, `page_size_bytes` long) and
                lies inside one of them.
        """

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata (before `start_load_kv`)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata bound for this step")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Load this step's external KV into its planned blocks (before the forward):
        to the end for a synchronous load, only started for an asynchronous one."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded (no-op: loads here are synchronous)."""
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Start saving one layer's KV (no-op: this engine's connectors save whole blocks)."""
        return None

    @abstractmethod
    def wait_for_save(self) -> None:
        """Finish saving this step's KV (after the forward)."""

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) request ids since the last call.

        Called after every step, also steps that schedule no token (the engine
        steps while requests wait for asynchronous loads), so it must not block.
        """
        return None, None

    def get_failed_recving(self) -> dict[str, str]:
        """Requests whose load failed since the last call -> why (their KV is missing)."""
        return {}

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        """What the scheduler side must learn from the worker side once registered (picklable)."""
        return None

    def shutdown(self) -> None:
        """Deregister memory and close side channels (worker and scheduler side)."""
        return None

    # ------------------------------------------------- sleep mode (both sides)
    def sleep(self) -> None:
        """The engine goes to sleep; its KV contents are about to be discarded.

        Called on the scheduler side after every request was aborted and the
        blocks held for remote readers were freed (forget what refers to KV
        contents: host copies, held requests), and on the worker side just
        before the KV pages are released (stop using them: a connector that
        registered them with a transport deregisters them here). The default
        does nothing.
        """
        return None

    def wake_up(self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]) -> None:
        """Worker side: the KV cache is mapped again (fresh zeroed pages, the same
        addresses and views, `regions` equal to those first registered); register
        them again. Afterwards the scheduler side gets the new
        `get_handshake_metadata()` through `set_xfer_handshake_metadata`. The
        default does nothing (a connector that keeps only the views).
        """
        return None

    # --------------------------------------------------------- scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` (the local prefix-cache hit) this connector can load.

        Returns:
            (num_external_tokens, load_async): load_async True makes the request
            wait in WAITING_FOR_REMOTE_KVS until `get_finished` reports its load.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """The request got its blocks (hits + new, in sequence order); plan its load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side; resets the step's plan."""

    def set_xfer_handshake_metadata(self, metadata: dict[str, Any] | None) -> None:
        """The worker side's `get_handshake_metadata()` (rank 0): before the first step,
        and again after each wake from sleep (then it updates what it serves)."""
        return None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the worker side reported this step."""
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished; `block_ids` are still its blocks.

        Returns:
            (delay_free, kv_transfer_params): delay_free keeps the blocks until
            the worker side reports the request in `finished_sending`;
            kv_transfer_params go back to the client with the response.
        """
        return False, None
