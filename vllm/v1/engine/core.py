"""EngineCore: one engine's start-up and its step. schedule -> execute -> update.

```
 step():  resize the KV cache if the elastic policy asks (between steps only)
          schedule -> execute on every rank -> update_from_output -> outputs
```

The step never waits on anything but the model: what takes unknown time runs
in the background and completes at a step boundary (docs/design.md, "One step
loop"). The loop that calls `step()` while serving is the engine core
process's (core_proc.py); the offline `LLMEngine` calls it from its caller.

With async scheduling (`SchedulerConfig.async_scheduling`) one step is in
flight while the next is scheduled and launched::

    step() call k:   schedule(N+1) -> execute(N+1) [launch]   then   get_output(N) -> update(N)
    device:          ...... step N ......|...... step N+1 ......|
    host:            schedule, prepare N+1 | wait N's ids, stop checks, detokenize

so the device never waits for the host between steps; the outputs of step N
come back from the call that launches step N+1.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any

from vllm import envs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.elastic import ElasticKVPolicy
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler, SchedulerStats
from vllm.v1.engine.elastic_kv import ElasticKVController, registry_name
from vllm.v1.engine.startup import start_workers
from vllm.v1.executor import Executor
from vllm.v1.outputs import (
    AsyncModelRunnerOutput,
    EngineCoreOutput,
    KVCacheMemory,
    ModelRunnerOutput,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import grammar_compiler_for
from vllm.v1.worker.elastic_kv_cache import ElasticBounds
from vllm.v1.worker.gpu_worker import Worker
from vllm.version import __version__

logger = init_logger(__name__)

# An idle elastic engine in a device registry looks for its peers' demands this
# often (a read of a few KiB of shared memory; ~0 CPU): an idle engine holding
# memory another one needs answers within this, not at its next request.
ELASTIC_IDLE_POLL_S = 0.02


class EngineCore:
    """Owns the scheduler and the executor (one worker per rank) of one engine.

    Every call to the workers goes through `model_executor.collective_rpc`
    with a `Worker` method (uni: in this process; mp / ray: one process or
    actor per rank), so the same code drives one rank or several. Start-up
    (`startup.start_workers`) decides the `StartupPlan`, sizes and warms up
    every rank, and only then is the scheduler built, once, with the final
    block count.

    It implements `EngineCoreUtilities` (protocol.py): what a frontend asks
    besides the request flow comes back as return values, never by reaching
    into the scheduler or the worker.

    Attributes:
        plan: the start-up decisions (KV cache path, utilization, final block
            count, fitted max_model_len).
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        # vLLM's start-up line: the settings asked for (async scheduling on or off,
        # the KV cache path, ...), once per engine (the core is one per engine,
        # in the server's engine core process or in the offline LLM's process).
        logger.info("Initializing a V1 LLM engine (v%s) with config: %s", __version__,
                    vllm_config.summary())
        self.vllm_config = vllm_config
        # Structured outputs: grammars compile in its thread pool, off the step; the
        # backend's tokenizer builds in the background from now, beside model loading.
        self.grammar_compiler = grammar_compiler_for(vllm_config)
        self.model_executor = Executor.get_class(vllm_config)(vllm_config)
        self.connector = None
        try:
            self.plan, bounds = start_workers(self.model_executor, vllm_config)
            if vllm_config.kv_transfer_config is not None:
                self.connector = self._create_scheduler_connector()
        except BaseException:
            self.model_executor.shutdown()  # no rank keeps its memory after a failed start
            self.grammar_compiler.shutdown()
            raise
        self.scheduler = self._make_scheduler(bounds)
        self.elastic_kv: ElasticKVController | None = None
        if self.scheduler.elastic is not None:
            mc = vllm_config.model_config
            share_as = (registry_name(mc.served_model_name, mc.model)
                        if envs.VLLM_ELASTIC_KV_SHARING else None)
            self.elastic_kv = ElasticKVController(
                self.scheduler, self.model_executor.collective_rpc, share_as, time.monotonic)
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # Async scheduling: steps launched whose outputs are not yet applied (at most 2).
        # Each entry: the step and its output to come.
        self._batch_queue: deque[tuple[SchedulerOutput, Any]] = deque()
        self._scheduled_req_ids: list[str] = []  # of the last (possibly failed) step
        self._kv_memory: KVCacheMemory | None = None  # cached; None = read it again
        self._sleeping: bool | None = False
        self._blocks_before_sleep = 0  # elastic: what a wake grows back towards

    def _make_scheduler(self, bounds: ElasticBounds | None) -> Scheduler:
        """The scheduler, built once with the final block count (and the elastic policy)."""
        config = self.vllm_config
        sched, cache, spec = config.scheduler_config, config.cache_config, config.speculative_config
        elastic = None
        if bounds is not None:
            elastic = ElasticKVPolicy(
                committed=self.plan.num_blocks, floor=bounds.floor, limit=bounds.limit,
                chunk=bounds.chunk, shrink_delay_s=envs.VLLM_ELASTIC_KV_SHRINK_DELAY_S)
        scheduler = Scheduler(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.plan.max_model_len,
            block_size=cache.block_size,
            num_blocks=self.plan.num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            max_num_partial_prefills=sched.max_num_partial_prefills,
            max_long_partial_prefills=sched.max_long_partial_prefills,
            connector=self.connector,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            num_lookahead_tokens=spec.num_lookahead_slots if spec else 0,
            async_scheduling=bool(sched.async_scheduling),
            scheduling_policy=sched.policy,
            elastic=elastic,
            grammar_compiler=self.grammar_compiler,
            encoder=(EncoderCacheManager(self.plan.encoder_cache_size, self.plan.encoder_budget)
                     if self.plan.encoder_budget else None),
        )
        scheduler.prefill_policy.log()
        return scheduler

    def _create_scheduler_connector(self):
        """The scheduler side of the configured KV connector (after the workers' side exists)."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.SCHEDULER)
        connector.set_xfer_handshake_metadata(self._connector_handshake())
        logger.info("KV connector %s (scheduler side), %d KV blocks",
                    type(connector).__name__, self.plan.num_blocks)
        return connector

    def _connector_handshake(self) -> dict | None:
        (handshake,) = self.model_executor.collective_rpc(
            Worker.kv_connector_handshake, unique_reply_rank=0)
        return handshake

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    @property
    def max_model_len(self) -> int:
        """Tokens one request may hold (the plan's, fitted to the KV cache)."""
        return self.plan.max_model_len

    @property
    def worker(self) -> Any:
        """The worker object when it runs in this process (uni executor), else None.

        For tests and benchmarks that inspect one rank's state; engine code asks
        the executor (`model_executor.collective_rpc`).
        """
        driver = getattr(self.model_executor, "driver", None)
        return None if driver is None else driver.worker

    # -------------------------------------------------------------- requests
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

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks a KV transfer still uses (steps poll for them)."""
        return self.scheduler.has_pending_kv_transfers()

    def waits_on_background_work(self) -> bool:
        """The last step scheduled no token although requests are unfinished: they wait
        for background work (a KV load) or for blocks; the loop may pause briefly."""
        return not self._scheduled_req_ids

    def scheduled_request_ids(self) -> list[str]:
        """Ids of the requests the last `step()` scheduled (also when it raised)."""
        return list(self._scheduled_req_ids)

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._step_async()
        self._scheduled_req_ids = []
        self.adjust_kv_cache()
        if not (self.scheduler.has_unfinished_requests()
                or self.scheduler.has_pending_kv_transfers()):
            return []
        scheduler_output = self.scheduler.schedule()
        self._scheduled_req_ids = list(scheduler_output.num_scheduled_tokens)
        runner_output = self._execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, _resolve(runner_output))

    def _execute(self, scheduler_output: SchedulerOutput) -> Any:
        (runner_output,) = self.model_executor.collective_rpc(
            Worker.execute_model, args=(scheduler_output,), unique_reply_rank=0)
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
            # No KV transfer reports to collect here: a KV connector turns async
            # scheduling off (vllm/config/vllm.py, VllmConfig._resolve_async_scheduling).
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
                scheduler_output, _resolve(runner_output))
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

    # ------------------------------------------------------ the elastic cache
    def adjust_kv_cache(self) -> bool:
        """Grow, shrink or release for a peer engine as the elastic policy asks (a no-op
        without the elastic cache, or asleep); see `ElasticKVController.adjust`.

        Called before every step and at every idle poll of the engine loop. With
        async scheduling the pages of a shrink are released at the next call (a
        step in flight may still write them; the workers wait for it).

        Returns:
            True when the committed block count, or a figure `kv_cache_memory()`
            reports (in use, reclaimable), changed.
        """
        if self.elastic_kv is None or self.is_sleeping():
            return False
        version = self.elastic_kv.figures_version
        changed = self.elastic_kv.adjust(step_in_flight=bool(self._batch_queue))
        if changed:
            self._kv_memory = None
        return changed or self.elastic_kv.figures_version != version

    def set_kv_cache_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling for the elastic cache in blocks' bytes summed over the ranks
        (the unit of `kv_cache_memory()`; None: the start-up limit).

        Blocks above it are released as soon as they are free (now, if they are).

        Returns:
            the limit in blocks (floor <= limit <= the start-up limit).

        Raises:
            RuntimeError: the elastic cache is off.
            ValueError: a limit that is negative or not an int.
        """
        if self.elastic_kv is None:
            raise RuntimeError("a KV cache limit needs --enable-elastic-kv-cache")
        limit = self.elastic_kv.set_limit(limit_bytes)
        self._kv_memory = None
        return limit

    @property
    def idle_poll_s(self) -> float | None:
        """How often the idle engine loop must call `adjust_kv_cache` (None: only when
        woken): an engine in a device registry answers its peers' demands."""
        sharing = self.elastic_kv is not None and self.elastic_kv.sharing is not None
        return ELASTIC_IDLE_POLL_S if sharing else None

    # ----------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> None:
        """Release the device memory of weights and KV cache (addresses are kept).

        Requests still queued or running are aborted first: their KV contents
        are about to be discarded. The prefix cache is emptied with them.
        """
        self._drain_batch_queue()  # no step may still write into the cache
        # Every request aborted, blocks held for remote readers freed (before the
        # workers deregister and release), the prefix cache emptied.
        self.scheduler.prepare_for_sleep()
        self._kv_memory = self._sleeping = None
        if self.elastic_kv is not None:  # wake commits the floor, then grows what fits
            self._blocks_before_sleep = self.elastic_kv.before_sleep()
        self.model_executor.collective_rpc(Worker.sleep, args=(level,))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Map memory back ("weights", "kv_cache", or both).

        Returns:
            True when the weights must be reloaded (woken after a level-2
            sleep) on any rank; see `Worker.wake_up`.
        """
        self._kv_memory = self._sleeping = None
        kv_was_asleep = self.connector is not None and self._kv_cache_asleep()
        reload = any(self.model_executor.collective_rpc(Worker.wake_up, args=(tags,)))
        if kv_was_asleep and not self._kv_cache_asleep():
            # The workers registered the woken KV memory again: new transfer metadata.
            self.connector.set_xfer_handshake_metadata(self._connector_handshake())
        if self.elastic_kv is not None and not self.is_sleeping():
            self.elastic_kv.after_wake(self._blocks_before_sleep)
            self._kv_memory = None
        elif self.elastic_kv is not None and not self._kv_cache_asleep():
            self.elastic_kv.kv_woken()  # only the weights still sleep
        return reload

    def _kv_cache_asleep(self) -> bool:
        return any("kv_cache" in tags
                   for tags in self.model_executor.collective_rpc(Worker.sleeping_tags))

    def is_sleeping(self) -> bool:
        """Whether any rank has weights or KV cache asleep (cached between sleep and wake)."""
        if self._sleeping is None:
            self._sleeping = any(self.model_executor.collective_rpc(Worker.sleeping_tags))
        return self._sleeping

    def reload_weights(self) -> None:
        self.model_executor.collective_rpc(Worker.reload_weights)

    # --------------------------------------------------------------- figures
    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def kv_cache_memory(self) -> KVCacheMemory:
        """Committed / reserved / in-use bytes (summed over the ranks), committed blocks
        and the limit: the elastic cache's, a fixed cache's own size.

        Read from the workers only when it can have changed (start-up, sleep,
        wake, a resize): the frontend asks after every step, and with worker
        processes each read is a round trip.
        """
        if self._kv_memory is None:
            per_rank = self.model_executor.collective_rpc(Worker.kv_cache_memory)
            elastic = self.scheduler.elastic
            num_grows, num_shrinks = (elastic.num_grows, elastic.num_shrinks) if elastic else (0, 0)
            block_bytes = sum(m.block_bytes for m in per_rank)
            self._kv_memory = KVCacheMemory(
                committed_bytes=sum(m.committed_bytes for m in per_rank),
                reserved_bytes=sum(m.reserved_bytes for m in per_rank),
                num_blocks=per_rank[0].num_blocks,
                physical_bytes=sum(m.physical_bytes for m in per_rank),
                block_bytes=block_bytes,
                # A fixed cache cannot grow: its limit is its blocks (also while asleep,
                # when nothing is committed: what it wakes to), so in use <= committed
                # <= limit holds on every path (both read 0 before 2026-12-07).
                limit_bytes=per_rank[0].num_blocks * block_bytes,
                num_grows=num_grows,
                num_shrinks=num_shrinks,
            )
        # The blocks requests hold change every step: from the scheduler's pool (no worker
        # round trip).
        block_bytes = self._kv_memory.block_bytes
        in_use = self.scheduler.kv_cache_manager.num_blocks_in_use() * block_bytes
        memory = replace(self._kv_memory, in_use_bytes=in_use)
        if self.elastic_kv is None:
            return memory
        # What could go now: from the controller's last publication.
        ekv = self.elastic_kv
        return replace(memory,
                       reclaimable_bytes=ekv.figures["reclaimable"] * block_bytes,
                       limit_bytes=self.scheduler.elastic.limit * block_bytes,
                       num_reclaims=ekv.num_reclaims)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop every worker (their device memory returns; processes are reaped)."""
        if self.connector is not None:
            self.connector.shutdown()
        if self.elastic_kv is not None:
            self.elastic_kv.close()
        self._batch_queue.clear()
        self.grammar_compiler.shutdown()
        self.model_executor.shutdown()


def _resolve(runner_output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    if isinstance(runner_output, AsyncModelRunnerOutput):
        return runner_output.get_output()
    return runner_output
