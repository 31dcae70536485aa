"""Ray plumbing for the `ray` executor: connect to a cluster, reserve one bundle per rank.

    ray.init(address)             RAY_ADDRESS / --ray-address, else a local cluster
    placement_group([{GPU: 1}] * world_size, strategy PACK)    (CPU: {CPU: 1})
        bundle r  ->  rank r's actor  (RayWorkerWrapper, a WorkerWrapper)

PACK fills a node before the next one, so a TP group stays on as few nodes as
possible (NCCL over NVLink, not the network); when one node cannot hold all
bundles, Ray spreads them, which is the multi-node case.

Ray is an optional dependency (`pip install vllm[ray]`); it is imported only here.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.executor.worker_wrapper import WorkerWrapper

logger = init_logger(__name__)


def import_ray() -> Any:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend 'ray' needs Ray: pip install 'vllm[ray]'"
        ) from e
    return ray


def worker_pythonpath() -> str:
    """PYTHONPATH for Ray workers: where this `vllm` and the current directory are, first.

    Ray starts actors from its own directory, so without this an actor could
    import another installed `vllm` than the engine's (on the head node the
    paths are the same files; on other nodes, entries that do not exist are
    skipped by Python).
    """
    package_root = Path(__file__).resolve().parents[3]  # .../vllm/v1/executor/ray_utils.py
    entries = [str(package_root), os.getcwd()]
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


def worker_env() -> dict[str, str]:
    """Environment every worker actor gets: this process's VLLM_* variables and PYTHONPATH."""
    env = envs.vllm_environ()
    env["PYTHONPATH"] = worker_pythonpath()
    return env


def initialize_ray_cluster(address: str | None) -> bool:
    """Connect to (or start) a Ray cluster unless this process already is connected.

    Args:
        address: a cluster address ("auto", "ray://...", "host:port"), None for
            RAY_ADDRESS when set, else a new local cluster.

    Returns:
        True when this call started the connection (the executor then owns it
        and calls ray.shutdown() when it shuts down).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    ray.init(
        address=address,
        ignore_reinit_error=True,
        log_to_driver=True,
        runtime_env={"env_vars": worker_env()},
    )
    return True


def device_resource(device_type: str) -> str:
    """The Ray resource a rank reserves: "GPU" on CUDA/ROCm, "CPU" on the host."""
    return "GPU" if device_type == "cuda" else "CPU"


def create_placement_group(world_size: int, resource: str) -> Any:
    """A placement group of `world_size` bundles of {resource: 1}, ready.

    Raises:
        RuntimeError: the cluster cannot grant it within VLLM_RAY_PG_TIMEOUT seconds;
            the message says what was asked and what the cluster has.
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [{resource: 1.0} for _ in range(world_size)]
    # One name per executor, not per process: removal is asynchronous in the GCS, so an
    # engine built right after another one's shutdown (two LLMs in one script) could
    # still find the old name taken ("name 'vllm-<pid>' already exists").
    name = f"vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    group = placement_group(bundles, strategy="PACK", name=name)
    timeout_s = envs.VLLM_RAY_PG_TIMEOUT  # how long the cluster may take to grant it
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        available = ray.available_resources().get(resource, 0)
        total = ray.cluster_resources().get(resource, 0)
        raise RuntimeError(
            f"Ray could not place {world_size} ranks (one {resource} each) within "
            f"{timeout_s:.0f} s: the cluster has {total:g} {resource} "
            f"({available:g} free) on {len(ray.nodes())} node(s); add nodes or lower "
            "--tensor-parallel-size"
        )
    return group


class RayWorkerWrapper(WorkerWrapper):
    """The actor of one rank: a WorkerWrapper plus what the driver asks of a Ray node."""

    def init_worker(self, worker_cls: str, kwargs: dict) -> int:
        from vllm.logger import set_process_label

        set_process_label(f"worker rank {kwargs['rank']} pid {os.getpid()}")
        return super().init_worker(worker_cls, kwargs)

    def get_node_and_device(self) -> tuple[str, str, list[str]]:
        """(Ray node id, node IP, accelerator ids Ray gave this actor)."""
        import ray

        context = ray.get_runtime_context()
        ids = context.get_accelerator_ids().get("GPU", [])
        return context.get_node_id(), ray.util.get_node_ip_address(), [str(i) for i in ids]

    def get_open_port(self) -> int:
        from vllm.distributed.utils import get_open_port

        return get_open_port()

    def ping(self) -> int:
        return os.getpid()

    def wait_until_dead(self) -> None:
        """Never returns; the driver's pending call fails when this actor dies."""
        import threading

        threading.Event().wait()
