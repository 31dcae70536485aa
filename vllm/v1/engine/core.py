"""EngineCore: the step loop. schedule -> execute -> update, and nothing else."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler, SchedulerStats
from vllm.v1.outputs import EngineCoreOutput, KVCacheMemory
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.gpu_worker import Worker

logger = init_logger(__name__)


class EngineCore:
    """Owns the worker and the scheduler of one engine.

    Start-up follows DESIGN.md section 4: load the model, size the KV cache
    (classic: final size; extensible: a small committed prefix), warm up and
    capture CUDA graphs, then (extensible) measure and extend, run the hooks
    that need the final cache (KV connectors), and only then build the
    scheduler, once, with the final block count.

    What the frontend needs from here comes as return values (`get_stats`,
    `kv_cache_memory`, `scheduled_request_ids`, `wake_up`, `is_sleeping`),
    never by reaching into the scheduler or the worker.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        sched = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        self.worker = Worker(vllm_config)
        self.worker.init_device()
        self.worker.load_model()
        self.worker.initialize_kv_cache()
        num_blocks = self.worker.compile_or_warm_up_model()
        self.worker.run_post_kv_cache_hooks()
        self.scheduler = Scheduler(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=vllm_config.model_config.max_model_len,
            block_size=cache.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            max_num_partial_prefills=sched.max_num_partial_prefills,
            max_long_partial_prefills=sched.max_long_partial_prefills,
        )
        self._scheduled_req_ids: list[str] = []  # of the last (possibly failed) step
        policy = self.scheduler.prefill_policy
        if policy.concurrent:
            logger.info(
                "Concurrent partial prefills: max_num_partial_prefills=%d, "
                "max_long_partial_prefills=%d, prompts over %d tokens count as long%s",
                policy.max_num_partial_prefills, policy.max_long_partial_prefills,
                policy.long_threshold,
                f" and compute at most {policy.cap} tokens a step" if policy.cap else "",
            )

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never fit."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """Requests that matched a stop string in the frontend."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        self._scheduled_req_ids = []
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        self._scheduled_req_ids = list(scheduler_output.num_scheduled_tokens)
        runner_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def scheduled_request_ids(self) -> list[str]:
        """Ids of the requests the last `step()` scheduled (also when it raised)."""
        return list(self._scheduled_req_ids)

    # ----------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> None:
        """Release the device memory of weights and KV cache (addresses are kept).

        Requests still queued or running are aborted first: their KV contents
        are about to be discarded. The prefix cache is emptied with them.
        """
        self.abort_requests(list(self.scheduler.requests))
        self.worker.sleep(level)
        self.scheduler.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Map memory back ("weights", "kv_cache", or both).

        Returns:
            True when the weights must be reloaded (woken after a level-2
            sleep); see `Worker.wake_up`.
        """
        return self.worker.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.worker.sleeping_tags())

    def reload_weights(self) -> None:
        self.worker.reload_weights()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def kv_cache_memory(self) -> KVCacheMemory:
        """Committed / reserved bytes and committed blocks of the KV cache."""
        return self.worker.kv_cache_memory()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.worker.shutdown()
