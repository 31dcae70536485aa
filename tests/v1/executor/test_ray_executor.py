"""The `ray` executor on a simulated two-node Ray cluster (two nodes of 1 CPU, one rank each)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.v1.executor.conftest import gone, make_config
from tests.v1.executor.workers import DistWorker
from vllm.v1.executor import Executor, WorkerDiedError, WorkerError

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    # Loopback only: Ray otherwise advertises the host's external address.
    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sigterm = signal.getsignal(signal.SIGTERM)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    # The head node and ray.init each set SIGTERM in this process (an exit), and
    # shutting down leaves it there: the test process keeps its own.
    signal.signal(signal.SIGTERM, sigterm)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if saved is None:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    else:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved


@pytest.fixture(scope="module")
def executor(two_node_cluster):
    from vllm.v1.executor.ray_executor import RayDistributedExecutor

    executor = RayDistributedExecutor(make_config(2, "ray"))
    assert executor.collective_rpc(DistWorker.init_device) == [0, 1]
    yield executor
    executor.shutdown()


def test_placement_groups_are_named_per_executor(two_node_cluster):
    """Two executors' groups alive in one process at once (before the executor fixture
    takes both CPUs): a name per process ("vllm-<pid>") made the second one fail."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    from vllm.v1.executor.ray_utils import create_placement_group

    groups = [create_placement_group(1, "CPU") for _ in range(2)]
    try:
        names = [placement_group_table(g)["name"] for g in groups]
        assert len(set(names)) == 2, names
        assert all(n.startswith(f"vllm-{os.getpid()}-") for n in names), names
    finally:
        for g in groups:
            remove_placement_group(g)


def test_one_rank_per_node(executor):
    assert Executor.get_class(make_config(2, "ray")) is type(executor)
    nodes = ray.get([w.get_node_and_device.remote() for w in executor.workers])
    assert len({node_id for node_id, _, _ in nodes}) == 2  # 1 CPU per node: one bundle each
    # The driver's node holds rank 0 (its address is the rendezvous).
    assert nodes[0][0] == ray.get_runtime_context().get_node_id()
    ranks = executor.collective_rpc(DistWorker.whoami)
    assert [(rank, driver) for rank, _, driver in ranks] == [(0, True), (1, False)]
    assert executor.collective_rpc(DistWorker.all_reduce, args=(2.0,)) == [5.0, 5.0]
    assert executor.collective_rpc(DistWorker.whoami, unique_reply_rank=1) == [ranks[1]]
    # The actors import this checkout's vllm and see the engine's VLLM_* variables.
    (pythonpath,) = executor.collective_rpc(DistWorker.env, args=("PYTHONPATH",),
                                            unique_reply_rank=0)
    assert pythonpath.split(os.pathsep)[0] == \
        os.path.dirname(os.path.dirname(os.path.abspath(__import__("vllm").__file__)))


def test_errors_name_the_rank(executor):
    with pytest.raises(WorkerError, match=r"rank 1 failed in fail_on: ValueError: bad value") as e:
        executor.collective_rpc(DistWorker.fail_on, args=(1,))
    assert e.value.rank == 1
    with pytest.raises(TimeoutError, match=r"nap did not finish within 0.2 s"):
        executor.collective_rpc(DistWorker.nap, args=(1.0,), timeout=0.2)
    assert executor.collective_rpc(DistWorker.nap, args=(0.0,)) == [0, 1]


def test_actor_death_is_reported(two_node_cluster, executor):
    failures = []
    fired = threading.Event()
    executor.register_failure_callback(lambda e: (failures.append(e), fired.set()))
    pids = [pid for _, pid, _ in executor.collective_rpc(DistWorker.whoami)]
    os.kill(pids[1], signal.SIGKILL)
    assert fired.wait(20), "the monitor did not report the killed actor"
    assert isinstance(failures[0], WorkerDiedError) and failures[0].rank == 1
    with pytest.raises(WorkerDiedError):
        executor.collective_rpc(DistWorker.whoami)
    executor.shutdown()
    assert gone(pids, timeout=20)


@pytest.mark.slow
def test_llm_tp2_across_two_nodes(two_node_cluster, tp_reference, limited_memory):
    """The bundled model split over the two simulated nodes: rank 1 cannot hold the
    extensible cache, so both ranks take the classic path; greedy ids equal one rank's,
    and both ranks hold the same block count, the one rank 1 (less free memory) can hold."""
    from tests.v1.e2e.test_tensor_parallel import ENGINE, check_agreement, greedy_ids
    from vllm import LLM

    # (runs after test_actor_death_is_reported freed the cluster's two CPUs; the
    # VLLM_* variables of `limited_memory` reach the actors with the engine's)
    llm = LLM(**ENGINE, tensor_parallel_size=2,  # Ray is initialised: the default is "ray"
              worker_cls="tests.v1.e2e.tp_workers.NoVmmOnRank1Worker")
    try:
        executor = llm.llm_engine.engine_core.model_executor
        assert executor.uses_ray
        nodes = ray.get([w.get_node_and_device.remote() for w in executor.workers])
        assert len({node_id for node_id, _, _ in nodes}) == 2
        plan = llm.llm_engine.engine_core.plan  # every rank's probe decided it
        assert plan.extensible_kv_cache is False
        assert plan.reason == "rank 1: VMM unsupported on this device (test)"
        assert greedy_ids(llm) == {p: ids for p, (ids, _) in tp_reference.items()}
        proposals = check_agreement(llm)
        assert proposals[1] < proposals[0], proposals
    finally:
        llm.llm_engine.shutdown()
