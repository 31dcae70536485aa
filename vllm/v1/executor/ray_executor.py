"""`RayDistributedExecutor`: one Ray actor per rank, in a placement group of one bundle per rank.

    engine process (Ray driver)
      placement group [bundle 0][bundle 1]...      one {GPU: 1} (CPU: {CPU: 1}) per rank
      actors          RayWorkerWrapper x world_size, rank r on bundle r
      ranks           ordered by (node, device): rank 0 on the driver's node when it has a bundle
      rendezvous      tcp://<rank 0's node IP>:<a port free there>
      monitor         one never-returning call per actor; it fails when the actor dies

On each node the actors' CUDA_VISIBLE_DEVICES is set to every device Ray gave
that node's actors, and an actor's local rank is the index of its own device
in that list (NCCL's peer-to-peer path needs the peers' devices visible).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.executor.abstract import Executor, first_error
from vllm.v1.executor.multiproc_executor import ERROR_GRACE_S
from vllm.v1.executor.ray_utils import (
    RayWorkerWrapper,
    create_placement_group,
    device_resource,
    import_ray,
    initialize_ray_cluster,
    worker_env,
)
from vllm.v1.executor.worker_wrapper import WorkerCall, WorkerDiedError

logger = init_logger(__name__)


class RayDistributedExecutor(Executor):
    """Workers as Ray actors; `collective_rpc` is one actor call per rank."""

    uses_ray = True

    def _init_executor(self) -> None:
        from vllm.distributed.utils import get_distributed_init_method
        from vllm.platforms import current_platform

        self._shutting_down = False
        self._lock = threading.Lock()
        self.workers: list[Any] = []
        self.placement_group = None
        self._owns_ray = False
        self._ray = ray = import_ray()
        try:
            self._owns_ray = initialize_ray_cluster(None)
            resource = device_resource(current_platform.device_type)
            self.placement_group = create_placement_group(self.world_size, resource)
            actors = self._create_actors(resource)
            nodes = ray.get([a.get_node_and_device.remote() for a in actors])
            order = self._rank_order(nodes)
            self.workers = [actors[i] for i in order]
            nodes = [nodes[i] for i in order]
            local_ranks = self._set_visible_devices(nodes)
            port = ray.get(self.workers[0].get_open_port.remote())
            init_method = get_distributed_init_method(nodes[0][1], port)
            self._init_workers(init_method, local_ranks)
        except BaseException:
            self.shutdown()
            raise
        self._start_monitor()
        logger.info(
            "Started %d Ray workers on %d node(s): %s",
            self.world_size,
            len({n[0] for n in nodes}),
            ", ".join(f"rank {r} on {n[1]}" for r, n in enumerate(nodes)),
        )

    def _create_actors(self, resource: str) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        num_gpus = 1 if resource == "GPU" else 0
        num_cpus = 1 if resource == "CPU" else 0
        actor_cls = self._ray.remote(
            num_cpus=num_cpus, num_gpus=num_gpus, concurrency_groups={"monitor": 1}
        )(RayWorkerWrapper)
        actors = []
        for bundle in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True,
            )
            actors.append(
                actor_cls.options(
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": worker_env()},
                    max_restarts=0,
                ).remote(rank=bundle)
            )
        return actors

    def _rank_order(self, nodes: list[tuple[str, str, list[str]]]) -> list[int]:
        """Actor indices in rank order: the driver's node first, then by node and device."""
        driver_node = self._ray.get_runtime_context().get_node_id()

        def key(i: int) -> tuple:
            node_id, _, devices = nodes[i]
            return (node_id != driver_node, node_id, [int(d) for d in devices if d.isdigit()])

        return sorted(range(len(nodes)), key=key)

    def _set_visible_devices(self, nodes: list[tuple[str, str, list[str]]]) -> list[int]:
        """Per node, show every actor all of that node's devices; returns each rank's local rank."""
        per_node: dict[str, list[str]] = {}
        for node_id, _, devices in nodes:
            per_node.setdefault(node_id, []).extend(devices)
        if not any(per_node.values()):  # CPU ranks: no device to pick
            return [0] * len(nodes)
        local_ranks, calls = [], []
        for worker, (node_id, _, devices) in zip(self.workers, nodes, strict=True):
            visible = sorted(set(per_node[node_id]), key=lambda d: (len(d), d))
            local_ranks.append(visible.index(devices[0]))
            env = {"CUDA_VISIBLE_DEVICES": ",".join(visible)}
            calls.append(worker.update_environment_variables.remote(env))
        self._ray.get(calls)
        return local_ranks

    def _init_workers(self, init_method: str, local_ranks: list[int]) -> None:
        calls = []
        for rank, (worker, local_rank) in enumerate(zip(self.workers, local_ranks, strict=True)):
            kwargs = {
                "vllm_config": self.vllm_config,
                "local_rank": local_rank,
                "rank": rank,
                "distributed_init_method": init_method,
                "is_driver_worker": rank == 0,
            }
            calls.append(worker.init_worker.remote(self.worker_cls, kwargs))
        self._get(calls, "start-up", None)

    # ------------------------------------------------------------------ calls
    def _collective_rpc(self, call: WorkerCall) -> list[Any]:
        with self._lock:
            self.check_health()
            if self._shutting_down:
                raise RuntimeError(f"the executor is shut down; cannot call {call.name}")
            refs = [
                worker.execute_method.remote(call.method, *call.args, **call.kwargs)
                for worker in self.workers
            ]
            results = self._get(refs, call.name, call.timeout)
        return call.replies(results)

    def _get(self, refs: list[Any], name: str, timeout: float | None) -> list[Any]:
        """Results of one call per rank, in rank order; rank-named errors."""
        ray = self._ray
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                if errors:  # the others wait in a collective the failed rank never joins
                    self._report_failure(first_error(errors))
                    raise first_error(errors)
                ranks = sorted(refs.index(ref) for ref in pending)
                raise TimeoutError(f"{name} did not finish within {timeout} s on rank(s) {ranks}")
            rank = refs.index(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                died = WorkerDiedError(rank, f"Ray actor died: {e.__class__.__name__}")
                self._report_failure(died)
                raise died from None
            except ray.exceptions.RayTaskError as e:
                errors[rank] = _task_error(e, rank, name)
                grace = time.monotonic() + ERROR_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
        if errors:
            raise first_error(errors)
        return [results[rank] for rank in range(len(refs))]

    # --------------------------------------------------------------- failures
    def _start_monitor(self) -> None:
        refs = [
            worker.wait_until_dead.options(concurrency_group="monitor").remote()
            for worker in self.workers
        ]
        self._monitor = threading.Thread(
            target=self._monitor_workers, args=(refs,), name="vllm-ray-monitor", daemon=True
        )
        self._monitor.start()

    def _monitor_workers(self, refs: list[Any]) -> None:
        ray = self._ray
        try:
            ready, _ = ray.wait(refs, num_returns=1)
        except Exception:  # Ray itself is shutting down
            return
        if self._shutting_down or not ready:
            return
        rank = refs.index(ready[0])
        self._report_failure(WorkerDiedError(rank, "Ray actor died"))

    def shutdown(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None or not ray.is_initialized():
            return
        self._shutting_down = True
        workers, self.workers = self.workers, []
        if workers:
            try:
                ray.wait([w.shutdown.remote() for w in workers], num_returns=len(workers),
                         timeout=10)
            except Exception:
                logger.exception("Ray workers' shutdown raised")
        for worker in workers:
            try:
                ray.kill(worker)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:
                logger.debug("remove_placement_group failed", exc_info=True)
            self.placement_group = None
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


def _task_error(error: Any, rank: int, name: str) -> BaseException:
    """A WorkerError naming the rank from a Ray task error (cause: the worker's exception)."""
    from vllm.v1.executor.worker_wrapper import RemoteFailure

    cause = getattr(error, "cause", None)
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
    return RemoteFailure(reason, str(error), cause).to_error(rank, name)
