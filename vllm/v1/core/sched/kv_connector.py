"""The scheduler side of a KV connector: external hits, held blocks, failed loads (torch-free).

    schedule()            waiting request W: hits = prefix cache, then
                          ext = external_tokens(W, hits) (the connector's match,
                          capped so W's last token is still computed); after the
                          allocation note_allocated(W, hits, ext)
    update_from_output()  update(kv_connector_output): blocks the connector
                          finished sending are freed; the requests whose load
                          failed are returned for the scheduler to finish with
                          an error (their blocks never entered the prefix cache)
    finished request      request_finished(R): the connector may hold R's blocks
                          until a remote reader took them (`sending`)
    sleep()               blocks held for remote readers are freed

`SchedulerKVConnector` is a component of the `Scheduler` (its `connector`
field): it owns the connector, the blocks held for sending and the external
hit counters, and never touches the scheduler's queues. The connectors
themselves (`KVConnectorBase_V1` and its subclasses) live in
`vllm/distributed/kv_transfer`, a layer above the core: the core names only
what it calls on one, `KVConnectorScheduler` below (tests/test_layers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vllm.logger import init_logger
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KVConnectorScheduler(Protocol):
    """What the scheduler calls on a KV connector's scheduler side (`KVConnectorBase_V1`
    in the scheduler role implements it; see its docstrings for the contract)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    def request_finished(
        self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...

    def sleep(self) -> None: ...


class SchedulerKVConnector:
    """A KV connector's scheduler side, as the scheduler uses it.

    Args:
        connector: the connector's scheduler-role instance.
        kv_cache_manager: the scheduler's (blocks are freed and looked up here).

    Attributes:
        sending: finished requests whose blocks the connector still sends.
        external_queries, external_hits: tokens asked of / loaded by the
            connector, cumulative (first admissions only).
    """

    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.sending: dict[str, Request] = {}
        self.external_queries = 0
        self.external_hits = 0

    def external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Tokens after the prefix-cache hit the connector loads (one token is left to compute)."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        return max(0, min(num_external, request.num_tokens - 1 - num_hit_tokens))

    def note_allocated(self, request: Request, num_hit_tokens: int, num_external: int) -> None:
        """The request got its blocks: count its external hit, tell the connector."""
        if request.num_preemptions == 0:
            self.external_queries += request.num_tokens - num_hit_tokens
            self.external_hits += num_external
        blocks = self.kv_cache_manager.get_blocks(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, num_external)

    def build_meta(self, scheduler_output: Any) -> Any:
        """The connector's metadata for this step's workers."""
        return self.connector.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(whether the connector holds the request's blocks, its kv_transfer_params).

        Held blocks stay allocated (in `sending`) until `update` reports them sent.
        """
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        delay_free, params = self.connector.request_finished(request, block_ids)
        if delay_free:
            self.sending[request.request_id] = request
        return delay_free, params

    def update(self, kv_output: KVConnectorOutput) -> dict[str, str]:
        """Free the blocks sent since the last step; returns the failed loads (id -> reason)."""
        self.connector.update_connector_output(kv_output)
        for req_id in kv_output.finished_sending:
            request = self.sending.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        return dict(kv_output.failed_recving)

    def sleep(self) -> None:
        """Before the engine sleeps (every request already aborted): free the blocks held
        for remote readers, whose contents are about to go, and let the connector
        forget what referred to KV contents."""
        for request in self.sending.values():
            self.kv_cache_manager.free(request)
        if self.sending:
            logger.info("Sleep: freed the blocks of %d finished request(s) no remote reader "
                        "took yet", len(self.sending))
        self.sending.clear()
        self.connector.sleep()
