"""What a connector registers: exactly the committed spans of the grown cache (host VMM pages).

NIXL is real here: the producer-side agent registers the spans, a loopback
READ between two registered blocks moves their bytes, and a descriptor just
past a segment's committed end (reserved, unmapped) is refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.v1.worker.test_kv_cache import LAYERS, PAGE, _config
from vllm.config import KVTransferConfig
from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.v1.worker.kv_cache import ExtensibleKVCacheBuffers
from vllm.v1.worker.kv_connector import WorkerKVConnector

CPU = torch.device("cpu")
CAPACITY, WARMUP, FINAL = 256, 2, 100


def _vllm_config(connector: str, role: str, extra: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(connector, role, extra),
                           cache_config=SimpleNamespace(block_size=16))


@pytest.fixture
def grown_cache():
    kv = ExtensibleKVCacheBuffers(_config(CAPACITY), HostVmmDriver(), CPU)
    kv.allocate(WARMUP)
    kv.extend_kv_cache(FINAL)
    yield kv
    kv.free()


CONNECTORS = [("OffloadingConnector", "kv_both", {"num_cpu_blocks": 4}),
              ("NixlConnector", "kv_producer", {})]


@pytest.mark.parametrize("name, role, extra", CONNECTORS, ids=[c[0] for c in CONNECTORS])
def test_registers_exactly_the_committed_spans(grown_cache, name, role, extra):
    if name == "NixlConnector":
        pytest.importorskip("nixl_cu13")
    kv = grown_cache
    base = kv.views[LAYERS[0]].data_ptr()
    # One span per layer segment, each exactly FINAL blocks; the reservation is far larger.
    expected = [(base + i * CAPACITY * PAGE, FINAL * PAGE) for i in range(len(LAYERS))]
    assert kv.committed_spans() == expected
    # A view's storage is its own segment's committed prefix (#16 item 1), never the reservation.
    assert kv.views[LAYERS[0]].untyped_storage().nbytes() == FINAL * PAGE
    before = kv.num_allocations
    assert before > len(LAYERS)  # the warmup commit and the extension are separate pages
    worker = WorkerKVConnector.create(_vllm_config(name, role, extra), kv)
    try:
        assert worker.connector.registered_regions == expected
        # NIXL (UCX) needs one allocation per registered segment: defragmented first.
        assert kv.num_allocations == (len(LAYERS) if name == "NixlConnector" else before)
    finally:
        worker.shutdown()


def _loopback_read(c, src: torch.Tensor, dst: torch.Tensor) -> str:
    agent = c.agent
    local = agent.get_xfer_descs([(dst.data_ptr(), PAGE, 0)], "DRAM")
    remote = agent.get_xfer_descs([(src.data_ptr(), PAGE, 0)], "DRAM")
    handle = agent.initialize_xfer("READ", local, remote, c.engine_id)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    return state


def test_nixl_registration_is_real(grown_cache):
    pytest.importorskip("nixl_cu13")
    kv = grown_cache
    worker = WorkerKVConnector.create(_vllm_config("NixlConnector", "kv_producer", {}), kv)
    c = worker.connector
    agent = c.agent
    try:
        src, dst = kv.views[LAYERS[0]][5], kv.views[LAYERS[2]][FINAL - 1]
        src.copy_(torch.arange(src.numel(), dtype=src.dtype).view_as(src))
        assert _loopback_read(c, src, dst) == "DONE" and torch.equal(dst, src)
        # The first reserved-but-uncommitted block of layer 0 was never registered.
        local = agent.get_xfer_descs([(dst.data_ptr(), PAGE, 0)], "DRAM")
        past_end = kv.views[LAYERS[0]].data_ptr() + FINAL * PAGE
        beyond = agent.get_xfer_descs([(past_end, PAGE, 0)], "DRAM")
        with pytest.raises(Exception, match="NIXL_ERR"):
            agent.initialize_xfer("READ", local, beyond, c.engine_id)
    finally:
        worker.shutdown()


def test_nixl_sleep_deregisters_and_wake_registers_the_same_spans(grown_cache):
    """Sleep (#13 item 4): deregistered before the pages go, the same spans registered
    again on the fresh pages (one allocation per segment, as after the defragment), the
    epoch counted in the handshake, and real transfers work again."""
    pytest.importorskip("nixl_cu13")
    kv = grown_cache
    worker = WorkerKVConnector.create(_vllm_config("NixlConnector", "kv_producer", {}), kv)
    c = worker.connector
    try:
        spans = kv.committed_spans()
        assert worker.handshake()["epoch"] == 0
        worker.sleep()
        assert c.reg_descs is None
        kv.release()
        kv.recommit()
        worker.wake_up(kv)
        assert c.registered_regions == spans == kv.committed_spans()
        assert kv.num_allocations == len(LAYERS)
        assert worker.handshake()["epoch"] == 1
        src, dst = kv.views[LAYERS[1]][3], kv.views[LAYERS[0]][FINAL - 1]
        src.copy_(torch.arange(src.numel(), dtype=src.dtype).view_as(src))
        assert _loopback_read(c, src, dst) == "DONE" and torch.equal(dst, src)
    finally:
        worker.shutdown()


def test_offload_host_blocks_from_bytes(grown_cache):
    """cpu_bytes_to_use -> whole blocks of all layers on the host."""
    config = _vllm_config("OffloadingConnector", "kv_both",
                          {"cpu_bytes_to_use": 10 * len(LAYERS) * PAGE + PAGE})
    worker = WorkerKVConnector.create(config, grown_cache)
    assert worker.connector.num_cpu_blocks == 10
    assert worker.handshake() == {"num_cpu_blocks": 10}
    host = worker.connector.host_caches[LAYERS[0]]
    assert host.shape == (10, *grown_cache.views[LAYERS[0]].shape[1:])
    too_small = _vllm_config("OffloadingConnector", "kv_both", {"cpu_bytes_to_use": PAGE})
    with pytest.raises(ValueError, match="holds no KV block: one block of all layers is"):
        WorkerKVConnector.create(too_small, grown_cache)
