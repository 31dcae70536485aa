"""The scheduler side of a KV connector: external hits, held blocks, failed loads (torch-free).

    schedule()            waiting request W: hits = prefix cache, then
                          ext = connector.get_num_new_matched_tokens(W, hits),
                          capped so W's last token is still computed; after the
                          allocation connector.update_state_after_alloc(W, ...)
    update_from_output()  kv_connector_output: blocks the connector finished
                          sending are freed; requests whose load failed finish
                          with an error (their blocks never entered the prefix cache)
    kv_connector_sleep()  sleep: blocks held for remote readers are freed

The connector itself (`KVConnectorBase_V1`) lives in
`vllm/distributed/kv_transfer`; this module only calls it.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.outputs import EngineCoreOutput, FinishReason, KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

logger = init_logger(__name__)


class KVConnectorSchedulerMixin:
    """The Scheduler's calls into its KV connector.

    Expects the Scheduler's `connector`, `kv_cache_manager`, `requests`,
    `running`, `sending`, `finished_req_ids`, `external_queries` and
    `external_hits`.
    """

    def _external_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """Tokens after the prefix-cache hit the connector loads (one token is left to compute)."""
        if self.connector is None or request.sampling_params.prompt_logprobs is not None:
            return 0
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        return max(0, min(num_external, request.num_tokens - 1 - num_hit_tokens))

    def _note_external(self, request: Request, num_hit_tokens: int, num_external: int) -> None:
        if request.num_preemptions == 0:
            self.external_queries += request.num_tokens - num_hit_tokens
            self.external_hits += num_external
        blocks = self.kv_cache_manager.get_blocks(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, num_external)

    def kv_connector_sleep(self) -> None:
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

    def _update_from_kv_connector(self, kv_output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Free blocks the connector finished sending; fail requests whose load failed.

        A failed request's blocks were never registered in the prefix cache
        (`allocate_slots` delays that for loaded blocks), so freeing them
        leaves no wrong KV behind. Its output carries the reason as `error`.
        """
        self.connector.update_connector_output(kv_output)
        for req_id in kv_output.finished_sending:
            request = self.sending.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        outputs = []
        failed = set()
        for req_id, reason in kv_output.failed_recving.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            logger.warning("request %s failed: its KV transfer failed: %s", req_id, reason)
            request.status = RequestStatus.FINISHED_ABORTED
            failed.add(request)
            self.kv_cache_manager.free(request)
            del self.requests[req_id]
            self.finished_req_ids.add(req_id)
            outputs.append(EngineCoreOutput(
                request_id=req_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                error=f"the KV transfer of request {req_id!r} failed: {reason}",
            ))
        if failed:
            self.running = [r for r in self.running if r not in failed]
        return outputs

