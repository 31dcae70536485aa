"""The worker side of a KV connector: created on the final cache, run around each step.

    Worker.run_post_kv_cache_hooks            (after extend_kv_cache: committed memory only)
      -> WorkerKVConnector.create(config, kv_cache)
           connector.register_kv_caches(views, kv_cache.committed_spans())
    Worker.execute_model(so)
      -> bind_connector_metadata -> start_load_kv -> runner.execute_model -> wait_for_save
         -> get_finished / get_failed_recving -> ModelRunnerOutput.kv_connector_output

Nothing here creates a connector before the cache has its final size, so a
connector never sees an uncommitted address. Sleep mode: `sleep()` before the
pages are released (deregister), `wake_up(kv_cache)` once they are back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.kv_cache import KVCacheBuffers

logger = init_logger(__name__)


class WorkerKVConnector:
    """Holds the worker-side connector and runs its hooks around one step."""

    def __init__(self, connector: KVConnectorBase_V1) -> None:
        self.connector = connector

    @classmethod
    def create(cls, vllm_config: VllmConfig, kv_cache: KVCacheBuffers) -> WorkerKVConnector:
        """Build the configured connector and register the committed cache with it."""
        connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER)
        if connector.needs_one_allocation_per_segment:
            before = kv_cache.num_allocations
            kv_cache.defragment()  # start-up: no request has written KV yet
            logger.info("KV cache defragmented for %s: %d physical allocation(s) -> %d",
                        type(connector).__name__, before, kv_cache.num_allocations)
            if kv_cache.rdma_unsupported_reason:
                logger.warning("KV cache pages are not GPUDirect-RDMA capable (%s): NIXL "
                               "transfers to other hosts cannot use RDMA from them",
                               kv_cache.rdma_unsupported_reason)
        spans = kv_cache.committed_spans()
        connector.register_kv_caches(dict(kv_cache.views), spans)
        logger.info(
            "KV connector %s (worker side) registered %d region(s), %.1f MiB committed",
            type(connector).__name__, len(spans), sum(n for _, n in spans) / 2**20,
        )
        return cls(connector)

    def execute(
        self, so: SchedulerOutput, run: Callable[[SchedulerOutput], ModelRunnerOutput]
    ) -> ModelRunnerOutput:
        """Load this step's external KV, run the step, save, and report what finished."""
        c = self.connector
        if so.kv_connector_metadata is not None:
            c.bind_connector_metadata(so.kv_connector_metadata)
            c.start_load_kv()
        output = run(so)
        if so.kv_connector_metadata is not None:
            c.wait_for_save()
            c.clear_connector_metadata()
        sending, recving = c.get_finished(so.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            failed_recving=dict(c.get_failed_recving()),
        )
        if kv_output.is_empty():
            return output
        # The empty output is a shared constant: never mutate it.
        return dataclasses.replace(output, kv_connector_output=kv_output)

    def sleep(self) -> None:
        """Before the KV pages are released: the connector stops using them."""
        self.connector.sleep()

    def wake_up(self, kv_cache: KVCacheBuffers) -> None:
        """After the KV pages are mapped again (same addresses): register them again.

        A recommit maps each segment as one allocation, so a transport that
        needs that (NIXL) gets it as it did after the start-up defragment.
        """
        spans = kv_cache.committed_spans()
        self.connector.wake_up(dict(kv_cache.views), spans)
        logger.info("KV connector %s (worker side) registered %d region(s) again after wake",
                    type(self.connector).__name__, len(spans))

    def handshake(self) -> dict | None:
        return self.connector.get_handshake_metadata()

    def shutdown(self) -> None:
        self.connector.shutdown()
