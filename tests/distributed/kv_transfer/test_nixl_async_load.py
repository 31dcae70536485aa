"""NixlConnector's worker side over real NIXL (UCX, DRAM): loads posted and polled, never waited.

A producer (its worker-side agent and its scheduler-side side channel, which
beats) and a consumer live in this process over plain host tensors; the
consumer's `start_load_kv` must return before the READ is done and
`get_finished` must report it later; a producer that stops beating fails the
loads that come after, alone.
"""

from __future__ import annotations

import dataclasses
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
from vllm.distributed.kv_transfer.kv_transfer_params import RemotePrefill, parse_kv_transfer_params
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

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


def _kept(pair, req_id: str, block_ids: list[int]) -> RemotePrefill:
    """The producer's scheduler side keeps a finished prefill's blocks: its params."""
    params = SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}})
    request = Request(req_id, [1, 2, 3], params, eos_token_id=None)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, kv_params = pair.side.request_finished(request, block_ids)
    assert delay_free
    return parse_kv_transfer_params({"kv_transfer_params": kv_params})


def _load(pair, req_id: str, local: list[int], remote: list[int]) -> tuple[float, int]:
    """Post one load; (seconds start_load_kv took, steps until it was reported)."""
    params = _kept(pair, req_id, remote)
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


def test_params_read_once_are_refused_the_second_time(pair):
    """A replayed (or copied) kv_transfer_params must never read blocks that may have
    been reused: the first claim takes them, a second one fails."""
    _load(pair, "r5", [1, 2], [3, 4])
    params = _kept(pair, "r6", [5])
    c = pair.consumer
    for attempt in ("first", "replay"):
        req_id = f"r6-{attempt}"
        c.bind_connector_metadata(NixlConnectorMetadata({req_id: ReqLoad([6], params, [5])}))
        c.start_load_kv()
        deadline = time.monotonic() + 10
        done, failed = set(), {}
        while not (done or failed) and time.monotonic() < deadline:
            done = c.get_finished(set())[1]
            failed = c.get_failed_recving()
        assert (done, failed) != (set(), {})
        if attempt == "first":
            assert done == {req_id}
        else:
            assert "another reader took them" in failed[req_id]


def test_a_silent_producer_fails_its_loads_alone(pair):
    _load(pair, "warm", [1], [1])
    params = _kept(pair, "r3", [3])
    pair.side.shutdown()  # its heartbeat stops (the process hangs or died)
    time.sleep(0.8)  # past liveness_timeout_s
    c = pair.consumer
    c.bind_connector_metadata(NixlConnectorMetadata({"r3": ReqLoad([3], params, [3])}))
    c.start_load_kv()
    c.get_finished(set())
    failed = c.get_failed_recving()
    assert list(failed) == ["r3"]
    assert "sent no heartbeat for" in failed["r3"]


def test_an_expired_lease_fails_the_load(pair):
    params = dataclasses.replace(_kept(pair, "r4", [3]), expires_at=time.time() + 0.5)
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
