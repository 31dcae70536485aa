"""`NixlConnector`: prefill/decode disaggregation over NIXL (vLLM's 1P1D), DRAM or VRAM.

    client -> proxy -> prefill instance (kv_producer)   max_tokens=1, kv_transfer_params=
                       |  computes the prompt's KV       {"do_remote_decode": true}
                       |  finishes; keeps the blocks, answers kv_transfer_params =
                       |  {do_remote_prefill, remote_block_ids, remote_engine_id,
                       |   remote_host, remote_port, remote_request_id}
                    -> decode instance (kv_consumer)        the same prompt + those params
                          scheduler: the prompt (less its last token) is "external"
                          worker:    side-channel handshake (once per remote engine):
                                     the remote NIXL agent's metadata and layer addresses;
                                     "held <engine> <request>?" (per request: the
                                     producer still holds the blocks); one NIXL READ
                                     of the remote blocks into the blocks just
                                     allocated, with a notification
                          the producer's worker sees the notification -> its blocks are freed

Memory: each side registers exactly `register_kv_caches`' regions (the
committed spans; DRAM on the CPU platform, VRAM on CUDA). Transfers address
block b of a layer as `view.data_ptr() + b * view.stride(0) * itemsize`, one
descriptor per (layer, run of consecutive block ids on both sides) where both
sides pack a layer's blocks back to back (stride == block bytes), else one per
(layer, block): the layout of either side may differ in strides as long as the
block shape is the same (`transfer_rows`).

The side channel (ZMQ REQ/REP, `side_channel_host`:`side_channel_port`, or
VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, default 127.0.0.1 and a free port) runs in
the producer's engine core process beside the scheduler, which knows at once
which requests' blocks it holds.

Failures: a dead or unreachable producer makes the handshake, the "held"
check or the READ fail; the request is reported in `failed_recving`, the scheduler frees its
blocks (never cached) and the client gets a 502 that says so. A producer
whose blocks are never read frees them after `abort_timeout_s` (default
VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 120 s; vLLM waits 480 s).

Sleep mode: either instance deregisters its KV memory before sleep releases the
pages (a producer frees the blocks it held for readers: their contents go, so
a decode request for them fails as a dead producer's would) and registers the
same regions again after waking. A new registration changes the agent's
metadata (UCX's remote keys), so the producer counts its registrations
(`epoch`): the "held" answer carries it, and a consumer whose cached handshake
has another epoch handshakes again before its READ.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_transfer_params import RemotePrefill, parse_kv_transfer_params
from vllm.logger import init_logger
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
TRANSFER_TIMEOUT_S = 30.0


def import_nixl():
    """`(nixl_agent, nixl_agent_config)` from whichever NIXL wheel is installed.

    Raises:
        ImportError: none is; the message names the PyPI packages.
    """
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise ImportError(
        "NixlConnector needs NIXL: pip install nixl-cu13 (or nixl-cu12 / nixl)"
    )


@dataclass
class ReqLoad:
    local_block_ids: list[int]
    remote: RemotePrefill
    remote_block_ids: list[int]


def block_runs(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, count) of the runs where both block ids go up by one."""
    runs: list[list[int]] = []
    for lb, rb in zip(local_ids, remote_ids, strict=True):
        if runs and lb == runs[-1][0] + runs[-1][2] and rb == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([lb, rb, 1])
    return [(a, b, n) for a, b, n in runs]


def transfer_rows(
    local_layers: dict[str, tuple[int, int, int]],
    remote_layers: dict[str, tuple[int, int, int]],
    local_ids: list[int], remote_ids: list[int], local_device: int, remote_device: int,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """NIXL descriptor rows (address, bytes, device id) reading remote blocks into local ones.

    Args:
        local_layers / remote_layers: layer -> (base address, block stride, block
            bytes), the same layer names on both sides.
        local_ids / remote_ids: block ids, pairwise (local_ids[i] <- remote_ids[i]).

    Returns:
        (local rows, remote rows) of equal length: per layer, one row per run
        of consecutive ids (`block_runs`) when both sides' stride equals the
        block bytes, else one row per block. A fresh engine allocates runs, so
        a 2,300-token prompt of the Llama-3-8B shape needs ~32 rows instead of
        ~4,600 (one per block per layer), each UCX request then moving
        megabytes rather than 64 KiB.

    Raises:
        ValueError: a layer's block bytes differ between the sides.
    """
    runs = block_runs(local_ids, remote_ids)
    local_rows, remote_rows = [], []
    for name, (base, stride, page) in local_layers.items():
        rbase, rstride, rpage = remote_layers[name]
        if rpage != page:
            raise ValueError(f"layer {name}: remote blocks are {rpage} bytes, local {page}")
        if stride == page and rstride == page:
            for lb, rb, n in runs:
                local_rows.append((base + lb * stride, n * page, local_device))
                remote_rows.append((rbase + rb * rstride, n * page, remote_device))
            continue
        for lb, rb in zip(local_ids, remote_ids, strict=True):
            local_rows.append((base + lb * stride, page, local_device))
            remote_rows.append((rbase + rb * rstride, page, remote_device))
    return local_rows, remote_rows


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    loads: dict[str, ReqLoad] = field(default_factory=dict)  # req id -> what to read
    sends: list[str] = field(default_factory=list)  # req ids whose blocks wait to be read


@dataclass
class _RemoteEngine:
    agent_name: str
    layers: dict[str, tuple[int, int, int]]  # layer -> (base, block stride, page bytes)
    device_id: int
    epoch: int  # its registration count when this handshake was made


class NixlConnector(KVConnectorBase_V1):
    """1P1D over NIXL: the producer keeps finished prompts' blocks until the consumer reads them."""

    needs_one_allocation_per_segment = True
    reads_pages_from_other_processes = True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        super().__init__(vllm_config, role)
        extra = self.kv_transfer_config.kv_connector_extra_config
        self.kv_role = self.kv_transfer_config.kv_role
        self.abort_timeout_s = float(extra.get("abort_timeout_s",
                                               envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT))
        self.host = extra.get("side_channel_host") or envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        self.port = int(extra.get("side_channel_port") or envs.VLLM_NIXL_SIDE_CHANNEL_PORT)
        self.backends = list(extra.get("backends") or ["UCX"])
        self.engine_id = ""
        # scheduler side
        self._loads: dict[str, ReqLoad] = {}
        self._sends: list[str] = []
        self._consumed: set[str] = set()
        self._held: set[str] = set()  # finished requests whose blocks wait to be read
        # worker side
        self.agent = None
        self.reg_descs = None
        self.registered_regions: list[tuple[int, int]] = []
        self.layers: dict[str, tuple[int, int, int]] = {}
        self.device_id = 0
        self.mem_type = "DRAM"
        self._remotes: dict[str, _RemoteEngine] = {}
        self.epoch = 0  # registrations of this engine's memory since the first (sleep/wake)
        self._send_deadlines: dict[str, float] = {}
        self._recving: set[str] = set()
        self._failed: dict[str, str] = {}
        self._side_channel: _SideChannel | None = None
        self._handshake = b""  # scheduler side: what the side channel serves

    # ------------------------------------------------------------ worker side
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]
    ) -> None:
        """Create this engine's NIXL agent and register exactly `regions` with it."""
        nixl_agent, nixl_agent_config = import_nixl()
        self.engine_id = uuid.uuid4().hex
        first = next(iter(kv_caches.values()))
        self.mem_type = "VRAM" if first.device.type == "cuda" else "DRAM"
        self.device_id = first.device.index or 0
        for name, view in kv_caches.items():
            if not view[0].is_contiguous():
                raise ValueError(f"NixlConnector needs contiguous blocks; layer {name} is not")
            self.layers[name] = (view.data_ptr(), view.stride(0) * view.element_size(),
                                 view[0].nbytes)
        self.agent = nixl_agent(self.engine_id, nixl_agent_config(backends=self.backends))
        self._register(regions)
        logger.info("NIXL agent %s: %d %s region(s) registered",
                    self.engine_id, len(regions), self.mem_type)

    def _register(self, regions: list[tuple[int, int]]) -> None:
        self.reg_descs = self.agent.register_memory(
            [(base, length, self.device_id, "") for base, length in regions], self.mem_type)
        self.registered_regions = list(regions)

    def _deregister(self) -> None:
        if self.agent is not None and self.reg_descs is not None:
            self.agent.deregister_memory(self.reg_descs)
            self.reg_descs = None

    def sleep(self) -> None:
        """Scheduler side: forget held requests (their blocks were freed). Worker side:
        deregister the KV memory before its pages go; sends still waiting are over."""
        if self.role == KVConnectorRole.SCHEDULER:
            self._held.clear()
            self._sends, self._loads = [], {}
            self._consumed.clear()
            return
        self._deregister()
        self._send_deadlines.clear()
        self._recving.clear()
        self._failed.clear()
        logger.info("NIXL agent %s: KV memory deregistered for sleep", self.engine_id)

    def wake_up(self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]) -> None:
        """Register the woken KV memory again (same regions); the epoch counts it.

        Raises:
            RuntimeError: the views or regions moved (they never do: sleep keeps
                every address), which would invalidate what remote engines know.
        """
        layers = {name: (v.data_ptr(), v.stride(0) * v.element_size(), v[0].nbytes)
                  for name, v in kv_caches.items()}
        if layers != self.layers or list(regions) != self.registered_regions:
            raise RuntimeError("the KV cache moved across sleep; NIXL cannot register it again")
        self._deregister()  # a wake without a sleep before it: nothing to undo
        self._register(regions)
        self.epoch += 1
        logger.info("NIXL agent %s: %d %s region(s) registered again after wake (epoch %d)",
                    self.engine_id, len(regions), self.mem_type, self.epoch)

    def get_handshake_metadata(self) -> dict[str, Any]:
        """What a remote decode instance needs to read from here (served by the side channel)."""
        return {
            "engine_id": self.engine_id,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "layers": self.layers, "device_id": self.device_id, "epoch": self.epoch,
        }

    def start_load_kv(self, **kwargs: Any) -> None:
        """Read every planned request's blocks (synchronously); failures go to `failed_recving`."""
        meta: NixlConnectorMetadata = self._get_connector_metadata()
        now = time.monotonic()
        for req_id in meta.sends:
            self._send_deadlines[req_id] = now + self.abort_timeout_s
        for req_id, load in meta.loads.items():
            try:
                self._read(load)
                self._recving.add(req_id)
            except Exception as e:  # any failure fails this request only
                r = load.remote
                self._failed[req_id] = (
                    f"could not read its KV from the prefill instance {r.engine_id} at "
                    f"{r.host}:{r.port}: {e}")
                self._forget_remote(r.engine_id)

    def _read(self, load: ReqLoad) -> None:
        import numpy as np

        epoch = self._check_held(load.remote)
        remote = self._remote_engine(load.remote, epoch)
        notif = load.remote.request_id.encode()
        if not load.local_block_ids:
            self.agent.send_notif(remote.agent_name, notif)
            return
        local_rows, remote_rows = transfer_rows(
            self.layers, remote.layers, load.local_block_ids, load.remote_block_ids,
            self.device_id, remote.device_id)
        local = self.agent.get_xfer_descs(np.array(local_rows, dtype=np.uint64), self.mem_type)
        rdescs = self.agent.get_xfer_descs(np.array(remote_rows, dtype=np.uint64), self.mem_type)
        handle = self.agent.initialize_xfer("READ", local, rdescs, remote.agent_name, notif)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + TRANSFER_TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ ended in state {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def _remote_engine(self, remote: RemotePrefill, epoch: int) -> _RemoteEngine:
        """The remote engine's agent and layers, handshaking when not known at `epoch`."""
        cached = self._remotes.get(remote.engine_id)
        if cached is not None and cached.epoch == epoch:
            return cached
        if cached is not None:  # it slept and registered its memory again: new keys
            logger.info("NIXL: engine %s registered its KV memory again (epoch %d -> %d); "
                        "handshaking again", remote.engine_id, cached.epoch, epoch)
            self._forget_remote(remote.engine_id)
        reply = json.loads(
            _SideChannel.request(remote.host, remote.port, b"handshake", HANDSHAKE_TIMEOUT_S))
        if reply["engine_id"] != remote.engine_id:
            raise RuntimeError(
                f"{remote.host}:{remote.port} is engine {reply['engine_id']}, not "
                f"{remote.engine_id} (the prefill instance restarted?)")
        if set(reply["layers"]) != set(self.layers):
            raise RuntimeError("the prefill instance serves a model with other layers")
        name = self.agent.add_remote_agent(base64.b64decode(reply["agent_metadata"]))
        name = name.decode() if isinstance(name, bytes) else name
        engine = _RemoteEngine(name, {k: tuple(v) for k, v in reply["layers"].items()},
                               reply["device_id"], int(reply.get("epoch", 0)))
        self._remotes[remote.engine_id] = engine
        return engine

    @staticmethod
    def _check_held(remote: RemotePrefill) -> int:
        """Ask the prefill instance whether it still holds the request's blocks.

        Why: a prefill instance that died, restarted, slept or timed the
        request out may have reused the blocks, and on some transports (shared
        memory on one host) a READ of a dead process's pages still "succeeds".

        Returns:
            the prefill instance's registration epoch (answer "1 <epoch>").
        """
        query = f"held {remote.engine_id} {remote.request_id}".encode()
        answer = _SideChannel.request(remote.host, remote.port, query, HANDSHAKE_TIMEOUT_S)
        held, _, epoch = answer.decode(errors="replace").partition(" ")
        if held != "1":
            raise RuntimeError(
                f"it no longer holds the blocks of request {remote.request_id!r} "
                "(timed out, went to sleep, or another engine now answers there)")
        return int(epoch or 0)

    def _forget_remote(self, engine_id: str) -> None:
        engine = self._remotes.pop(engine_id, None)
        if engine is not None:
            try:
                self.agent.remove_remote_agent(engine.agent_name)
            except Exception:  # best effort: it may be half-known
                logger.debug("removing remote agent %s failed", engine.agent_name)

    def wait_for_save(self) -> None:
        return None  # the consumer reads; the producer has nothing to push

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Sends confirmed by a consumer's notification (or timed out); reads done."""
        sending: set[str] = set()
        if self.agent is not None and self.kv_role != "kv_consumer":
            for messages in self.agent.get_new_notifs().values():
                sending.update(m.decode() for m in messages)
            now = time.monotonic()
            for req_id, deadline in list(self._send_deadlines.items()):
                if req_id in sending:
                    del self._send_deadlines[req_id]
                elif now > deadline:
                    logger.warning("request %s: no decode instance read its KV within %.0f s; "
                                   "freeing its blocks", req_id, self.abort_timeout_s)
                    del self._send_deadlines[req_id]
                    sending.add(req_id)
        recving, self._recving = self._recving, set()
        return sending, recving

    def get_failed_recving(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    def has_pending_sends(self) -> bool:
        return bool(self._send_deadlines)

    def shutdown(self) -> None:
        """Stop the side channel, drop remote agents, deregister (before the memory goes)."""
        if self._side_channel is not None:
            self._side_channel.close()
            self._side_channel = None
        if self.role == KVConnectorRole.SCHEDULER:
            return
        for engine_id in list(self._remotes):
            self._forget_remote(engine_id)
        self._deregister()

    # --------------------------------------------------------- scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[str, Any] | None) -> None:
        """The worker's agent; a producer starts its side channel here (engine core process).

        The side channel lives beside the scheduler because it answers "does
        this engine still hold request X's blocks?" from `self._held`, which
        the scheduler updates the moment a request finishes (before its
        response leaves), so a decode instance never asks too early. After a
        wake the worker's new metadata (its next epoch) replaces what it serves.
        """
        self.engine_id = metadata["engine_id"]
        self.epoch = int(metadata.get("epoch", 0))
        if self.kv_role == "kv_consumer":
            return
        self._handshake = json.dumps(metadata).encode()
        if self._side_channel is not None:
            return

        def answer(query: bytes) -> bytes:
            if query == b"handshake":
                return self._handshake
            _, engine_id, req_id = query.decode().split(" ", 2)
            if engine_id == self.engine_id and req_id in self._held:
                return f"1 {self.epoch}".encode()
            return b"0"

        self._side_channel = _SideChannel(self.host, self.port, answer)
        self.port = self._side_channel.port
        logger.info("NIXL side channel of engine %s on %s:%d", self.engine_id, self.host,
                    self.port)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._held.difference_update(connector_output.finished_sending)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """A request sent by the proxy with a prefill's params: its prompt is external."""
        remote = self._remote_prefill(request)
        if remote is None:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        remote = self._remote_prefill(request)
        if remote is None:
            return
        self._consumed.add(request.request_id)
        first = request.num_computed_tokens // self.block_size  # the local hit
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        end = min(end, len(remote.block_ids))
        self._loads[request.request_id] = ReqLoad(
            [b.block_id for b in blocks[first:end]], remote, remote.block_ids[first:end])

    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        if self.kv_role == "kv_producer" or request.request_id in self._consumed:
            return None
        params = parse_kv_transfer_params(request.sampling_params.extra_args)
        return params if isinstance(params, RemotePrefill) else None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = NixlConnectorMetadata(self._loads, self._sends)
        self._loads, self._sends = {}, []
        for req_id in scheduler_output.finished_req_ids:
            self._consumed.discard(req_id)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A prefill for a remote decode keeps its blocks and says where they are."""
        params = (request.sampling_params.extra_args or {}).get("kv_transfer_params") or {}
        if (self.kv_role == "kv_consumer" or not params.get("do_remote_decode")
                or not block_ids or request.get_finished_reason() is None
                or str(request.get_finished_reason()) == "abort"):
            return False, None
        self._sends.append(request.request_id)
        self._held.add(request.request_id)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(block_ids), "remote_engine_id": self.engine_id,
            "remote_host": self.host, "remote_port": self.port,
            "remote_request_id": request.request_id,
        }


class _SideChannel:
    """A ZMQ REP socket on a thread: `answer(query bytes) -> reply bytes`."""

    def __init__(self, host: str, port: int, answer) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        while not self._stop.is_set():
            if self._sock.poll(100, zmq.POLLIN):
                query = self._sock.recv()
                try:
                    reply = self._answer(query)
                except Exception:  # a malformed query must not stop the channel
                    reply = b"0"
                self._sock.send(reply)
        self._sock.close()

    @staticmethod
    def request(host: str, port: int, query: bytes, timeout_s: float) -> bytes:
        """One round trip; raises TimeoutError when nobody answers in time."""
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send(query)
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise TimeoutError(f"no answer from its side channel {host}:{port} in "
                                   f"{timeout_s:.0f} s (is it running?)")
            return sock.recv()
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._ctx.term()
