"""ElasticKVController between steps, on a real scheduler and policy, fake worker RPCs and
a real device registry in a temporary directory."""
import logging

import pytest

from tests.v1.core.fake_runner import make_request, make_scheduler
from vllm import envs
from vllm.v1.core.elastic import ElasticKVPolicy
from vllm.v1.core.elastic_sharing import DeviceShare, DeviceSharing
from vllm.v1.engine.elastic_kv import ElasticKVController
from vllm.v1.worker.gpu_worker import Worker

B = 1 << 20  # bytes per block


class FakeWorkers:
    """The workers' elastic RPCs: a growth starts on the helper thread and ends at 300."""

    def __init__(self):
        self.committed = 100
        self.growth = None

    def __call__(self, method, args=(), **_):
        if method is Worker.kv_cache_device:
            return [("dev", B)]
        if method is Worker.grow_kv_cache_ahead:
            if self.growth is None:  # starts on the helper thread
                self.growth = "running"
                return [(self.committed, True, [])]
            self.committed, self.growth = 300, None  # partial: memory ran out at 300
            return [(300, False, [200, 300])]
        if method is Worker.shrink_kv_cache:
            self.committed = args[0]
            return [args[0]]
        if method is Worker.move_kv_blocks:
            return [None]
        raise AssertionError(method)


def test_a_lacking_engine_answers_a_peer_with_the_count_it_holds_now(tmp_path, monkeypatch):
    """An engine that lacks memory still answers a peer holding less, down to the midpoint
    of the two; the midpoint must use what it committed in this very call (found in
    review: it used the figure published before the growth and gave too much)."""
    monkeypatch.setenv("VLLM_KV_REGISTRY_DIR", str(tmp_path))
    now = [0.0]
    clock = lambda: now[0]
    policy = ElasticKVPolicy(committed=100, floor=100, limit=1000, chunk=400, clock=clock)
    sched = make_scheduler(num_blocks=100, block_size=16, max_model_len=4096,
                           max_num_batched_tokens=4096, elastic=policy)
    for i in range(2):  # 500 blocks wanted: A lacks after any growth to 300
        sched.add_request(make_request(f"w{i}", 4000, max_tokens=1))
    workers = FakeWorkers()
    a = ElasticKVController(sched, workers, "A", clock)
    peer = DeviceSharing([DeviceShare("dev", B)], "B", clock=clock)
    try:
        peer.publish(committed=50, in_use=50, reclaimable=0, floor=50, limit=1000)
        a.adjust()  # growth starts on the helper thread
        assert sched.num_blocks == 100
        peer.want(200)  # B (50 blocks) lacks 200
        a.adjust()  # the growth to 300 is adopted, A still lacks, and answers B
        # A held 300 and B 50 when A answered: it may keep no less than the midpoint (175),
        # so B never ends above A. With the figure published before the growth (100) as
        # A's committed, A keeps max(75, floor) and gives B 200: B 250 > A 100.
        assert sched.num_blocks >= (300 + 50) // 2, (
            f"A released down to {sched.num_blocks} blocks for B (50 + what A gave)")
    finally:
        peer.close()
        a.close()


@pytest.mark.parametrize("make, cause", [
    (lambda d: None, "does not exist"),
    (lambda d: d.write_text(""), "is not a directory"),
])
def test_a_registry_directory_that_cannot_be_used_is_named_with_its_own_hint(
        tmp_path, monkeypatch, caplog, make, cause):
    """VLLM_KV_REGISTRY_DIR naming no directory: the engine serves without the registry and
    its one warning says the directory's problem and names the variable (it said "remove the
    file or set VLLM_KV_REGISTRY_DIR", the hint for a foreign file, which stays that)."""
    directory = tmp_path / "registry"
    make(directory)
    monkeypatch.setenv("VLLM_KV_REGISTRY_DIR", str(directory))
    sched = make_scheduler(num_blocks=100, block_size=16, max_model_len=4096,
                           max_num_batched_tokens=4096,
                           elastic=ElasticKVPolicy(committed=100, floor=100, limit=1000,
                                                           chunk=100))
    with caplog.at_level(logging.WARNING):
        controller = ElasticKVController(sched, FakeWorkers(), "A", lambda: 0.0)
    assert controller.sharing is None
    (warning,) = [r.getMessage() for r in caplog.records if "device registry" in r.getMessage()]
    assert f"KV registry directory {directory} {cause}" in warning
    assert warning.endswith("set VLLM_KV_REGISTRY_DIR to a directory this user can write, "
                            "or unset it (default /dev/shm)"), warning
    assert "remove the file" not in warning

    monkeypatch.setenv("VLLM_KV_REGISTRY_DIR", str(tmp_path))  # a foreign file: its hint
    envs.reset()
    (tmp_path / "vllm-kv-dev").write_bytes(b"NOTAKVR9" + bytes(20_000))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ElasticKVController(sched, FakeWorkers(), "A", lambda: 0.0)
    assert caplog.records[-1].getMessage().endswith(
        "is not a KV registry of this version): no reclaim on a peer's demand, idle release "
        "on the timer only; remove the file or set VLLM_KV_REGISTRY_DIR")
