"""NixlConnector's worker side over real NIXL (UCX, DRAM): loads posted and polled, never waited.

A producer (its worker-side agent and its scheduler-side side channel, which
beats) and a consumer live in this process over plain host tensors; the
consumer's `start_load_kv` must return before the READ is done and
`get_finished` must report it later; a producer that stops beating fails the
loads that come after, alone.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
    NixlConnector,
    NixlConnectorMetadata,
    ReqLoad,
    block_indices,
    strided_rows,
)
from vllm.distributed.kv_transfer.kv_transfer_params import RemotePrefill

LAYERS, NUM_BLOCKS, BLOCK_ELEMS = ("l0", "l1", "l2"), 64, 4096  # 16 KiB fp32 blocks


def test_indices_address_every_layer_of_each_block():
    assert block_indices(2, 10, [3, 4, 9]).tolist() == [3, 4, 9, 13, 14, 19]
    assert block_indices(3, 5, []).size == 0
    rows = strided_rows({"b": (2000, 64, 32, 7), "a": (1000, 64, 64, 5)}, device_id=1)
    # Name order: one row per layer (address, block bytes, device, stride, count).
    assert rows.tolist() == [[1000, 64, 1, 64, 5], [2000, 32, 1, 64, 7]]
    assert rows.dtype == np.uint64


def _config(role: str, extra: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=KVTransferConfig("NixlConnector", role, extra),
                           cache_config=SimpleNamespace(block_size=16))


def _worker(role: str, caches: dict[str, torch.Tensor], **extra) -> NixlConnector:
    c = NixlConnector(_config(role, extra), KVConnectorRole.WORKER)
    c.register_kv_caches(caches, sorted((t.data_ptr(), t.nbytes) for t in caches.values()))
    return c


@pytest.fixture
def pair():
    pytest.importorskip("nixl_cu13")
    src = {n: torch.randn(NUM_BLOCKS, BLOCK_ELEMS) for n in LAYERS}
    dst = {n: torch.zeros(NUM_BLOCKS, BLOCK_ELEMS) for n in LAYERS}
    producer = _worker("kv_producer", src)
    side = NixlConnector(_config("kv_producer", {}), KVConnectorRole.SCHEDULER)
    side.set_xfer_handshake_metadata(producer.get_handshake_metadata())
    consumer = _worker("kv_consumer", dst, liveness_timeout_s=0.5)
    yield SimpleNamespace(src=src, dst=dst, producer=producer, side=side, consumer=consumer)
    for c in (consumer, side, producer):
        c.shutdown()


def _load(pair, req_id: str, local: list[int], remote: list[int]) -> tuple[float, int]:
    """Post one load; (seconds start_load_kv took, steps until it was reported)."""
    params = RemotePrefill(remote, pair.producer.engine_id, "127.0.0.1", pair.side.port,
                           req_id, epoch=0, expires_at=time.time() + 60)
    c = pair.consumer
    c.bind_connector_metadata(NixlConnectorMetadata({req_id: ReqLoad(local, params, remote)}))
    start = time.perf_counter()
    c.start_load_kv()
    posted = time.perf_counter() - start
    c.clear_connector_metadata()
    for steps in range(1, 100_000):
        _, recving = c.get_finished(set())
        failed = c.get_failed_recving()
        if recving or failed:
            assert not failed, failed
            assert recving == {req_id}
            return posted, steps
        time.sleep(0.001)
    raise AssertionError("the load never finished")


def test_load_is_posted_then_reported_and_moves_the_bytes(pair):
    local, remote = [5, 6, 7, 30], [40, 41, 42, 2]
    posted, steps = _load(pair, "r1", local, remote)
    assert steps > 1  # the first load handshakes in the background: not in start_load_kv
    for name in LAYERS:
        assert torch.equal(pair.dst[name][local], pair.src[name][remote])
    # The producer's worker hears of the read through NIXL's notification.
    deadline = time.monotonic() + 5
    sent: set[str] = set()
    pair.producer._send_deadlines["r1"] = time.monotonic() + 60
    while "r1" not in sent and time.monotonic() < deadline:
        sent |= pair.producer.get_finished(set())[0]
    assert "r1" in sent
    posted2, _ = _load(pair, "r2", [8, 9], [10, 11])  # handshake cached: posted at once
    assert posted2 < 0.05
    assert torch.equal(pair.dst["l2"][[8, 9]], pair.src["l2"][[10, 11]])


def test_a_silent_producer_fails_its_loads_alone(pair):
    _load(pair, "warm", [1], [1])
    pair.side.shutdown()  # its heartbeat stops (the process hangs or died)
    time.sleep(0.8)  # past liveness_timeout_s
    params = RemotePrefill([3], pair.producer.engine_id, "127.0.0.1", pair.side.port, "r3",
                           epoch=0, expires_at=time.time() + 60)
    c = pair.consumer
    c.bind_connector_metadata(NixlConnectorMetadata({"r3": ReqLoad([3], params, [3])}))
    c.start_load_kv()
    c.get_finished(set())
    failed = c.get_failed_recving()
    assert list(failed) == ["r3"]
    assert "sent no heartbeat for" in failed["r3"]


def test_an_expired_lease_fails_the_load(pair):
    params = RemotePrefill([3], pair.producer.engine_id, "127.0.0.1", pair.side.port, "r4",
                           epoch=0, expires_at=time.time() + 0.5)  # inside the 1 s margin
    c = pair.consumer
    c.bind_connector_metadata(NixlConnectorMetadata({"r4": ReqLoad([3], params, [3])}))
    c.start_load_kv()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        c.get_finished(set())
        failed = c.get_failed_recving()
        if failed:
            assert "hold expired" in failed["r4"]
            return
        time.sleep(0.005)
    raise AssertionError("the expired lease was not noticed")
