"""The scheduler side of a KV connector: external hits, background loads, held blocks.

    schedule()            waiting request W: hits = prefix cache, then
                          (ext, async) = external_tokens(W, hits) (the connector's
                          match, capped so W's last token is still computed); after
                          the allocation note_allocated(W, hits, ext). A synchronous
                          load runs in the same step as W's first tokens; an
                          asynchronous one (NIXL) makes W wait in
                          WAITING_FOR_REMOTE_KVS (`start_load`) while every other
                          request keeps stepping
    update_from_output()  update(kv_connector_output) -> KVTransferUpdate: blocks the
                          connector finished sending are freed; loads reported done
                          are handed back for promotion (`loaded`, W is scheduled
                          from its loaded prefix on), failed ones for an error
                          (`failed`; their blocks never entered the prefix cache)
    finish (abort)        a request aborted while its load runs keeps its blocks
                          until the worker reports the load over (`abort_load`):
                          the READ may still be writing into them
    finished request      request_finished(R): the connector may hold R's blocks
                          until a remote reader took them (`sending`)
    sleep()               blocks held for remote readers or aborted loads are freed

`SchedulerKVConnector` is a component of the `Scheduler` (its `connector`
field): it owns the connector, the blocks held for sending or for a load in
flight and the external hit counters, and never touches the scheduler's
queues; the scheduler moves requests between states with what it returns. The
connectors themselves (`KVConnectorBase_V1` and its subclasses) live in
`vllm/distributed/kv_transfer`, a layer above the core: the core names only
what it calls on one, `KVConnectorScheduler` below (tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class KVTransferUpdate:
    """What one step's `KVConnectorOutput` means for the scheduler's requests.

    Attributes:
        loaded: requests whose background load finished: their first
            `num_computed_tokens` tokens are in their blocks (set here).
        failed: requests whose load failed -> why ("its KV transfer failed: ...";
            their blocks are still held; the scheduler finishes them with it).
    """

    loaded: list[Request] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class SchedulerKVConnector:
    """A KV connector's scheduler side, as the scheduler uses it.

    Args:
        connector: the connector's scheduler-role instance.
        kv_cache_manager: the scheduler's (blocks are freed and looked up here).

    Attributes:
        sending: finished requests whose blocks the connector still sends.
        loading: requests in WAITING_FOR_REMOTE_KVS -> the tokens their load
            brings (hits included): their blocks are being written in the background.
        aborted_loads: requests finished while their load ran; their blocks are
            freed once the worker reports the load over (done or failed).
        external_queries, external_hits: tokens asked of / loaded by the
            connector, cumulative (first admissions only).
    """

    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.sending: dict[str, Request] = {}
        self.loading: dict[str, int] = {}
        self.aborted_loads: dict[str, Request] = {}
        self.external_queries = 0
        self.external_hits = 0

    def external_tokens(self, request: Request, num_hit_tokens: int) -> tuple[int, bool]:
        """(tokens after the prefix-cache hit the connector loads, whether it loads them
        in the background); one token is always left to compute."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(
            request, num_hit_tokens)
        num_external = max(0, min(num_external, request.num_tokens - 1 - num_hit_tokens))
        return num_external, load_async and num_external > 0

    def start_load(self, request: Request, num_loaded_tokens: int) -> None:
        """The request waits for its background load of `num_loaded_tokens` tokens
        (prefix-cache hits included); its blocks were allocated and noted."""
        self.loading[request.request_id] = num_loaded_tokens

    def abort_load(self, request: Request) -> None:
        """A request finished while its load runs: hold its blocks until the load is over."""
        del self.loading[request.request_id]
        self.aborted_loads[request.request_id] = request

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

    def update(self, kv_output: KVConnectorOutput, requests: dict[str, Request]
               ) -> KVTransferUpdate:
        """Apply one step's transfer report.

        Frees the blocks sent since the last step and those of aborted
        requests whose load is over; sets `num_computed_tokens` of the requests
        whose load finished.

        Args:
            kv_output: what the worker side reported.
            requests: the scheduler's unfinished requests by id.
        """
        self.connector.update_connector_output(kv_output)
        for req_id in kv_output.finished_sending:
            request = self.sending.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        update = KVTransferUpdate()
        for req_id in (*kv_output.finished_recving, *kv_output.failed_recving):
            aborted = self.aborted_loads.pop(req_id, None)
            if aborted is not None:
                self.kv_cache_manager.free(aborted)
        for req_id in kv_output.finished_recving:
            num_loaded = self.loading.pop(req_id, None)
            if num_loaded is not None and req_id not in kv_output.failed_recving:
                request = requests[req_id]
                request.num_computed_tokens = num_loaded
                update.loaded.append(request)
        for req_id, reason in kv_output.failed_recving.items():
            self.loading.pop(req_id, None)
            update.failed[req_id] = f"its KV transfer failed: {reason}"
        return update

    def num_held_blocks(self) -> int:
        """Blocks of finished requests held for a remote reader or a load in flight."""
        get = self.kv_cache_manager.get_blocks
        return sum(len(get(req_id)) for req_id in (*self.sending, *self.aborted_loads))

    def has_pending_transfers(self) -> bool:
        """Blocks held for a remote reader or for an aborted request's load in flight
        (steps must go on polling the worker until they are freed)."""
        return bool(self.sending or self.aborted_loads)

    def sleep(self) -> None:
        """Before the engine sleeps (every request already aborted): free the blocks held
        for remote readers, whose contents are about to go, and let the connector
        forget what referred to KV contents."""
        for request in (*self.sending.values(), *self.aborted_loads.values()):
            self.kv_cache_manager.free(request)
        if self.sending:
            logger.info("Sleep: freed the blocks of %d finished request(s) no remote reader "
                        "took yet", len(self.sending))
        self.sending.clear()
        self.aborted_loads.clear()
        self.connector.sleep()
