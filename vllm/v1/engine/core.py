"""EngineCore: the step loop. schedule -> execute -> update, and nothing else.

With async scheduling (`SchedulerConfig.async_scheduling`) one step is in
flight while the next is scheduled and launched::

    step() call k:   schedule(N+1) -> execute(N+1) [launch]   then   get_output(N) -> update(N)
    device:          ...... step N ......|...... step N+1 ......|
    host:            schedule, prepare N+1 | wait N's ids, stop checks, detokenize

so the device never waits for the host between steps; the outputs of step N
come back from the call that launches step N+1.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler, SchedulerStats
from vllm.v1.engine.elastic_kv import ElasticKVController
from vllm.v1.executor import Executor
from vllm.v1.outputs import (
    AsyncModelRunnerOutput,
    EngineCoreOutput,
    KVCacheMemory,
    ModelRunnerOutput,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.kv_cache_sizing import fit_max_model_len
from vllm.version import __version__

logger = init_logger(__name__)


class EngineCore:
    """Owns the scheduler and the executor (one worker per rank) of one engine.

    Every call to the workers goes through `model_executor.collective_rpc`
    (uni: in this process; mp / ray: one process or actor per rank), so the
    same code drives one rank or several. Start-up follows DESIGN.md section 4
    on every rank: load the model, size the KV cache
    (classic: final size; extensible: a small committed prefix), warm up and
    capture CUDA graphs, then (extensible) measure and extend, run the hooks
    that need the final cache (KV connectors), and only then build the
    scheduler, once, with the final block count.

    What the frontend needs from here comes as return values (`get_stats`,
    `kv_cache_memory`, `scheduled_request_ids`, `wake_up`, `is_sleeping`),
    never by reaching into the scheduler or the worker.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        # vLLM's start-up line: the settings in use (async scheduling on or off,
        # the KV cache path, ...), once per engine (the core is one per engine,
        # in the server's engine core process or in the offline LLM's process).
        logger.info("Initializing a V1 LLM engine (v%s) with config: %s", __version__,
                    vllm_config.summary())
        self.vllm_config = vllm_config
        sched = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        self.model_executor = Executor.get_class(vllm_config)(vllm_config)
        self.connector = None
        try:
            num_blocks = self._start_workers()
            if vllm_config.kv_transfer_config is not None:
                self.connector = self._create_scheduler_connector(num_blocks)
        except BaseException:
            self.model_executor.shutdown()  # no rank keeps its memory after a failed start
            raise
        bounds = None
        if cache.enable_elastic_kv_cache:
            bounds = self.model_executor.collective_rpc("elastic_kv_cache_bounds")[0]
        # Elastic: a request may use what the cache can grow to, not what it holds now.
        self.max_model_len = self._fit_max_model_len(bounds.limit if bounds else num_blocks)
        self.scheduler = Scheduler(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=cache.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            max_num_partial_prefills=sched.max_num_partial_prefills,
            max_long_partial_prefills=sched.max_long_partial_prefills,
            connector=self.connector,
            num_speculative_tokens=(
                vllm_config.speculative_config.num_speculative_tokens
                if vllm_config.speculative_config else 0
            ),
            num_lookahead_tokens=(
                vllm_config.speculative_config.num_lookahead_slots
                if vllm_config.speculative_config else 0
            ),
            async_scheduling=bool(sched.async_scheduling),
        )
        self.async_scheduling = bool(sched.async_scheduling)
        # Async scheduling: steps launched whose outputs are not yet applied (at most 2).
        self._batch_queue: deque[tuple[SchedulerOutput, Any]] = deque()
        self._scheduled_req_ids: list[str] = []  # of the last (possibly failed) step
        self.elastic = (
            None if bounds is None
            else ElasticKVController(self.model_executor, self.scheduler, bounds)
        )
        policy = self.scheduler.prefill_policy
        if policy.concurrent:
            logger.info(
                "Concurrent partial prefills: max_num_partial_prefills=%d, "
                "max_long_partial_prefills=%d, prompts over %d tokens count as long%s",
                policy.max_num_partial_prefills, policy.max_long_partial_prefills,
                policy.long_threshold,
                f" and compute at most {policy.cap} tokens a step" if policy.cap else "",
            )
        self._kv_memory: KVCacheMemory | None = None  # cached; None = read it again
        self._sleeping: bool | None = False

    def _start_workers(self) -> int:
        """Every rank through start-up; returns the block count they agreed on.

        Raises:
            WorkerError: a rank failed a stage (the message names it; uni:
                the worker's own exception).
            ValueError: the extensible cache was required and a rank cannot hold it.
        """
        run = self.model_executor.collective_rpc
        run("init_device")
        self._agree_on_kv_cache_path()
        run("load_model")
        run("initialize_kv_cache")
        counts = run("compile_or_warm_up_model")
        if len(set(counts)) != 1:  # the workers' agreement makes this impossible
            raise RuntimeError(f"the ranks ended with different block counts: {counts}")
        run("run_post_kv_cache_hooks")
        return counts[0]

    def _create_scheduler_connector(self, num_blocks: int):
        """The scheduler side of the configured KV connector (after the workers' side exists)."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.SCHEDULER)
        (handshake,) = self.model_executor.collective_rpc(
            "kv_connector_handshake", unique_reply_rank=0
        )
        connector.set_xfer_handshake_metadata(handshake)
        logger.info("KV connector %s (scheduler side), %d KV blocks",
                    type(connector).__name__, num_blocks)
        return connector

    def _fit_max_model_len(self, num_blocks: int) -> int:
        """max_model_len, lowered (with a warning) to what the final KV cache holds."""
        configured = self.vllm_config.model_config.max_model_len
        block_size = self.vllm_config.cache_config.block_size
        fitted = fit_max_model_len(configured, num_blocks, block_size)
        if fitted < configured:
            logger.warning(
                "max_model_len %d does not fit the KV cache: %d blocks of %d tokens hold "
                "%d tokens for one sequence; serving with max_model_len %d (raise "
                "--kv-cache-memory-bytes or --gpu-memory-utilization, or lower "
                "--max-model-len, to silence this)",
                configured, num_blocks - 1, block_size, fitted, fitted,
            )
        return fitted

    def _agree_on_kv_cache_path(self) -> None:
        """One rank that cannot hold the extensible cache puts every rank on the classic path."""
        cache = self.vllm_config.cache_config
        if not cache.enable_extensible_kv_cache or self.model_executor.world_size == 1:
            return  # one rank: VllmConfig resolution probed its device already
        reasons = self.model_executor.collective_rpc("probe_kv_cache_path")
        failed = [f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason]
        if failed:
            reason = "; ".join(failed)
            cache.fall_back_to_classic(reason)  # raises when it was required
            self.model_executor.collective_rpc("use_classic_kv_cache", args=(reason,))

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    @property
    def worker(self) -> Any:
        """The worker object when it runs in this process (uni executor), else None.

        For tests and benchmarks that inspect one rank's state; engine code asks
        the executor (`model_executor.collective_rpc`).
        """
        driver = getattr(self.model_executor, "driver", None)
        return None if driver is None else driver.worker

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never fit."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """Requests that matched a stop string in the frontend."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or a launched step whose outputs are still due."""
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def has_pending_kv_sends(self) -> bool:
        """Finished requests whose blocks a KV connector still sends (steps poll for them)."""
        return bool(self.scheduler.sending)

    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._step_async()
        self._scheduled_req_ids = []
        self.adjust_kv_cache()
        if not (self.scheduler.has_unfinished_requests() or self.scheduler.sending):
            return []
        scheduler_output = self.scheduler.schedule()
        self._scheduled_req_ids = list(scheduler_output.num_scheduled_tokens)
        runner_output = self._execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, _resolve(runner_output))

    def _execute(self, scheduler_output: SchedulerOutput) -> Any:
        (runner_output,) = self.model_executor.collective_rpc(
            "execute_model", args=(scheduler_output,), unique_reply_rank=0
        )
        return runner_output

    def _step_async(self) -> list[EngineCoreOutput]:
        """Launch the next step, then apply the outputs of the one before it.

        The first call after an idle engine launches a step and returns
        nothing; each later call returns the outputs of the step launched by
        the call before. When nothing can be scheduled, the step in flight is
        waited for. If a step fails, every step in flight fails with it
        (`scheduled_request_ids` names all their requests).
        """
        queue = self._batch_queue
        self._scheduled_req_ids = []
        self.adjust_kv_cache()
        try:
            launched = False
            if self.scheduler.has_unfinished_requests():
                scheduler_output = self.scheduler.schedule()
                self._scheduled_req_ids = list(scheduler_output.num_scheduled_tokens)
                runner_output = self._execute(scheduler_output)
                if not scheduler_output.is_empty:
                    queue.append((scheduler_output, runner_output))
                    launched = True
            if not queue or (launched and len(queue) == 1):
                return []  # nothing was in flight: launch the next step before waiting
            scheduler_output, runner_output = queue[0]
            outputs = self.scheduler.update_from_output(
                scheduler_output, _resolve(runner_output)
            )
            queue.popleft()
            return outputs
        except BaseException:
            in_flight = [r for so, _ in queue for r in so.num_scheduled_tokens]
            self._scheduled_req_ids = list(dict.fromkeys([*in_flight, *self._scheduled_req_ids]))
            queue.clear()
            raise

    def _drain_batch_queue(self) -> None:
        """Wait for the steps in flight and apply their outputs (before memory goes away)."""
        while self._batch_queue:
            scheduler_output, runner_output = self._batch_queue.popleft()
            self.scheduler.update_from_output(scheduler_output, _resolve(runner_output))

    def adjust_kv_cache(self) -> bool:
        """The elastic cache grows or shrinks here, between steps (a no-op otherwise).

        Called before every step and at every idle poll of the engine loops.
        With async scheduling a shrink waits until no step is in flight (a
        block freed after a step was launched can be one that step writes).

        Returns:
            True when the committed block count changed.
        """
        if (self.elastic is not None and not self.is_sleeping()
                and self.elastic.adjust(allow_shrink=not self._batch_queue)):
            self._kv_memory = None
            return True
        return False

    def set_kv_cache_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling for the elastic cache in bytes (None: the start-up limit).

        Returns:
            the limit in blocks (floor <= limit <= the start-up limit).

        Raises:
            RuntimeError: the elastic cache is off.
        """
        if self.elastic is None:
            raise RuntimeError("a KV cache limit needs --enable-elastic-kv-cache")
        limit = self.elastic.set_limit(limit_bytes)
        self._kv_memory = None
        return limit

    def scheduled_request_ids(self) -> list[str]:
        """Ids of the requests the last `step()` scheduled (also when it raised)."""
        return list(self._scheduled_req_ids)

    # ----------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> None:
        """Release the device memory of weights and KV cache (addresses are kept).

        Requests still queued or running are aborted first: their KV contents
        are about to be discarded. The prefix cache is emptied with them.
        """
        self._drain_batch_queue()  # no step may still write into the cache
        self.abort_requests(list(self.scheduler.requests))
        if self.scheduler.connector is not None:
            self.scheduler.kv_connector_sleep()  # before the workers deregister and release
        self._kv_memory = self._sleeping = None
        if self.elastic is not None:  # wake commits the floor, then grows what fits
            self._blocks_before_sleep = self.scheduler.num_blocks
            self.scheduler.reset_prefix_cache()
            self.elastic.shrink_to_floor()
        self.model_executor.collective_rpc("sleep", args=(level,))
        self.scheduler.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Map memory back ("weights", "kv_cache", or both).

        Returns:
            True when the weights must be reloaded (woken after a level-2
            sleep) on any rank; see `Worker.wake_up`.
        """
        self._kv_memory = self._sleeping = None
        connector = self.scheduler.connector
        kv_was_asleep = connector is not None and self._kv_cache_asleep()
        reload = any(self.model_executor.collective_rpc("wake_up", args=(tags,)))
        if kv_was_asleep and not self._kv_cache_asleep():
            # The workers registered the woken KV memory again: new transfer metadata.
            (handshake,) = self.model_executor.collective_rpc(
                "kv_connector_handshake", unique_reply_rank=0)
            connector.set_xfer_handshake_metadata(handshake)
        if self.elastic is not None and not self.is_sleeping():
            self.elastic.regrow(getattr(self, "_blocks_before_sleep", 0))
            self._kv_memory = None
        return reload

    def _kv_cache_asleep(self) -> bool:
        return any("kv_cache" in tags for tags in self.model_executor.collective_rpc(
            "sleeping_tags"))

    def is_sleeping(self) -> bool:
        """Whether any rank has weights or KV cache asleep (cached between sleep and wake)."""
        if self._sleeping is None:
            self._sleeping = any(self.model_executor.collective_rpc("sleeping_tags"))
        return self._sleeping

    def reload_weights(self) -> None:
        self.model_executor.collective_rpc("reload_weights")

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def kv_cache_memory(self) -> KVCacheMemory:
        """Committed / reserved bytes (summed over the ranks) and committed blocks.

        Read from the workers only when it can have changed (start-up, sleep,
        wake): the frontend asks after every step, and with worker processes
        each read is a round trip.
        """
        if self._kv_memory is None:
            self._kv_memory = self._read_kv_cache_memory()
        return self._kv_memory

    def _read_kv_cache_memory(self) -> KVCacheMemory:
        per_rank = self.model_executor.collective_rpc("kv_cache_memory")
        policy = None if self.elastic is None else self.elastic.policy
        return KVCacheMemory(
            committed_bytes=sum(m.committed_bytes for m in per_rank),
            reserved_bytes=sum(m.reserved_bytes for m in per_rank),
            num_blocks=per_rank[0].num_blocks,
            num_grows=0 if policy is None else policy.num_grows,
            num_shrinks=0 if policy is None else policy.num_shrinks,
        )

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop every worker (their device memory returns; processes are reaped)."""
        if self.connector is not None:
            self.connector.shutdown()
        self._batch_queue.clear()
        self.model_executor.shutdown()


def _resolve(runner_output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    if isinstance(runner_output, AsyncModelRunnerOutput):
        return runner_output.get_output()
    return runner_output
