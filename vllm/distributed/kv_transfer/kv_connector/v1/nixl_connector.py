"""`NixlConnector`: prefill/decode disaggregation over NIXL (vLLM's 1P1D), DRAM or VRAM.

    client -> proxy -> prefill instance (kv_producer)   max_tokens=1, kv_transfer_params=
                       |  computes the prompt's KV       {"do_remote_decode": true}
                       |  finishes; keeps the blocks, answers kv_transfer_params =
                       |  {do_remote_prefill, remote_block_ids, remote_engine_id,
                       |   remote_host, remote_port, remote_request_id,
                       |   remote_epoch, remote_expires_at}
                    -> decode instance (kv_consumer)        the same prompt + those params
                          scheduler: blocks for the prompt; the request waits in
                                     WAITING_FOR_REMOTE_KVS, every other request steps on
                          worker:    handshake once per producer (background thread):
                                     its agent, its layers' descriptor list prepared
                                     (`prep_xfer_dlist`), its heartbeat subscribed;
                                     per request a claim of the blocks, then one READ
                                     by block indices (`make_prepped_xfer`, NIXL merges
                                     neighbours), posted and polled between steps
                          promoted:  READ done, producer alive at the same epoch, lease
                                     not expired -> the request computes its last
                                     prompt token; else it fails alone, blocks freed
                          the producer's worker sees the READ's notification -> frees

No step waits on a transfer: posting a READ and polling it and the heartbeat
are non-blocking (`start_load_kv`, `get_finished`); the handshake runs on a
thread; the engine core steps every ~1 ms while requests wait only for loads.

Memory: each side registers exactly `register_kv_caches`' regions (committed
spans; DRAM on the CPU, VRAM on CUDA), deregistered for sleep and registered
again after waking (new UCX keys: readers handshake again). Descriptor lists
are prepared once (the local one at registration, a producer's at its
handshake): one per (layer, block), index `layer * num_blocks + block`.

Liveness (nixl_side_channel.py): the first claim of a request's blocks wins,
so replayed params never read reused blocks. A producer beats every 50 ms with
its engine id and epoch (sleep count); a READ is not posted, nor promoted,
unless the newest beat is younger than `liveness_timeout_s` (default 5 s),
from the same engine, at the blocks' epoch, with 1 s of the request's lease
(`remote_expires_at`) left. A producer that sleeps bumps its epoch and waits
two beats before its pages go.

Failures (an unreachable producer, a failed, refused or timed-out READ or
claim, a stale heartbeat, an expired lease) fail that request only; the
scheduler frees its blocks (never cached) and the client gets a 502 naming
the reason. Blocks nobody reads are freed after `abort_timeout_s` (default
VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 120 s; vLLM waits 480 s).
"""

from __future__ import annotations

import base64
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl_agent import (
    block_indices,
    make_agent,
    strided_rows,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl_side_channel import (
    HEARTBEAT_S,
    ClaimClient,
    HeartbeatMonitor,
    SideChannel,
    fetch_handshake,
    log_ucx_endpoints,
    ucx_lanes,
)
from vllm.distributed.kv_transfer.kv_transfer_params import RemotePrefill, parse_kv_transfer_params
from vllm.logger import init_logger

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

TRANSFER_TIMEOUT_S, LIVENESS_TIMEOUT_S = 30.0, 5.0  # the extra-config keys' defaults
LEASE_MARGIN_S = 1.0  # a lease with less left is treated as expired (clock skew, delivery)


@dataclass
class ReqLoad:
    local_block_ids: list[int]
    remote: RemotePrefill
    remote_block_ids: list[int]


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    loads: dict[str, ReqLoad] = field(default_factory=dict)  # req id -> what to read
    sends: list[str] = field(default_factory=list)  # req ids whose blocks wait to be read


@dataclass
class _RemoteEngine:
    agent_name: str
    layers: dict[str, tuple[int, int, int, int]]  # layer -> (base, stride, page, num_blocks)
    epoch: int  # its registration count when this handshake was made
    dlist: Any  # its prepared descriptor list
    heartbeat: HeartbeatMonitor
    claims: ClaimClient
    read_once: bool = False  # a READ from it finished (its transport is logged then)


class _EngineFailure(RuntimeError):
    """The producer itself failed (not just one request's blocks): every load from it fails."""


@dataclass
class _Load:
    """A load in flight on the worker side."""

    load: ReqLoad
    deadline: float  # time.monotonic()
    handle: Any = None  # the READ once posted
    claim_deadline: float = 0.0  # set when the claim of its blocks was sent


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
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", TRANSFER_TIMEOUT_S))
        self.liveness_timeout_s = float(extra.get("liveness_timeout_s", LIVENESS_TIMEOUT_S))
        self.host = extra.get("side_channel_host") or envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        self.port = int(extra.get("side_channel_port") or envs.VLLM_NIXL_SIDE_CHANNEL_PORT)
        self.backends = list(extra.get("backends") or ["UCX"])
        self.engine_id = ""
        self.epoch = 0  # sleeps (scheduler side) / registrations after the first (worker)
        # scheduler side
        self._loads: dict[str, ReqLoad] = {}
        self._sends: list[str] = []
        self._consumed: set[str] = set()
        self._held: set[str] = set()  # finished requests whose blocks no reader claimed yet
        self._side_channel: SideChannel | None = None
        self._handshake = b""  # what the side channel serves
        # worker side
        self.agent = self.reg_descs = self.local_dlist = None
        self.registered_regions: list[tuple[int, int]] = []
        self.layers: dict[str, tuple[int, int, int, int]] = {}
        self.device_id, self.mem_type = 0, "DRAM"
        self._remotes: dict[str, _RemoteEngine] = {}
        self._handshakes: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, _Load] = {}
        self._send_deadlines: dict[str, float] = {}
        self._recving: set[str] = set()
        self._failed: dict[str, str] = {}
        self._ucx_log: str | None = None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], regions: list[tuple[int, int]]
    ) -> None:
        """Create this engine's NIXL agent, register exactly `regions` with it and
        prepare the local descriptor list (every block of every layer)."""
        import uuid

        self.engine_id = uuid.uuid4().hex
        first = next(iter(kv_caches.values()))
        self.mem_type = "VRAM" if first.device.type == "cuda" else "DRAM"
        self.device_id = first.device.index or 0
        for name, view in kv_caches.items():
            if not view[0].is_contiguous():
                raise ValueError(f"NixlConnector needs contiguous blocks; layer {name} is not")
            self.layers[name] = (view.data_ptr(), view.stride(0) * view.element_size(),
                                 view[0].nbytes, view.shape[0])
        self._ucx_log = log_ucx_endpoints()
        self.agent = make_agent(self.engine_id, self.backends)
        self._register(regions)
        logger.info("NIXL agent %s: %d %s region(s) registered, %d descriptors prepared",
                    self.engine_id, len(regions), self.mem_type,
                    sum(n for *_, n in self.layers.values()))

    def _register(self, regions: list[tuple[int, int]]) -> None:
        self.reg_descs = self.agent.register_memory(
            [(base, length, self.device_id, "") for base, length in regions], self.mem_type)
        self.registered_regions = list(regions)
        self.local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", strided_rows(self.layers, self.device_id), self.mem_type)

    def _deregister(self) -> None:
        if self.local_dlist is not None:
            self.agent.release_dlist_handle(self.local_dlist)
            self.local_dlist = None
        if self.agent is not None and self.reg_descs is not None:
            self.agent.deregister_memory(self.reg_descs)
            self.reg_descs = None

    def sleep(self) -> None:
        """Scheduler side: count the sleep (the heartbeat carries it) and wait two beats,
        so readers know before the pages go. Worker side: drop loads in flight and
        deregister the KV memory before its pages go; sends still waiting are over."""
        if self.role == KVConnectorRole.SCHEDULER:
            self._sends, self._loads = [], {}
            self._consumed.clear()
            self._held.clear()
            self.epoch += 1
            if self._side_channel is not None:
                time.sleep(2 * HEARTBEAT_S + 0.02)
            return
        for pending in self._pending.values():  # their requests were aborted
            self._release(pending)
        self._pending.clear()
        self._deregister()  # what it knows of producers stays valid
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
        layers = {name: (v.data_ptr(), v.stride(0) * v.element_size(), v[0].nbytes, v.shape[0])
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
        """Note this step's sends, post this step's loads (or their handshakes); returns
        at once. Loads finish in later steps (`get_finished`)."""
        meta: NixlConnectorMetadata = self._get_connector_metadata()
        now = time.monotonic()
        for req_id in meta.sends:
            self._send_deadlines[req_id] = now + self.abort_timeout_s
        for req_id, load in meta.loads.items():
            self._pending[req_id] = _Load(load, now + self.transfer_timeout_s)
        if meta.loads:
            self._progress()

    def _progress(self) -> None:
        """Move every load in flight one stage on: handshake -> claim sent -> claim granted,
        READ posted -> READ done."""
        claims: dict[str, bool] = {}
        for engine in self._remotes.values():  # each producer's news once per call
            engine.heartbeat.poll()
            claims.update(engine.claims.answers())
        for req_id, pending in list(self._pending.items()):
            if req_id not in self._pending:
                continue  # failed with its engine meanwhile
            remote = pending.load.remote
            try:
                if time.monotonic() > pending.deadline:
                    raise TimeoutError(f"the transfer took over {self.transfer_timeout_s:.0f} s")
                engine = self._remote_engine(remote)
                if engine is None:
                    continue  # its handshake runs
                self._check_alive(engine, remote)
                if not pending.load.local_block_ids:  # the local hits covered it: no READ
                    self.agent.send_notif(engine.agent_name, remote.request_id.encode())
                    self._done(req_id)
                    continue
                if pending.handle is None:
                    self._claim_then_post(engine, pending, claims.get(remote.request_id))
                    continue
                state = self.agent.check_xfer_state(pending.handle)
                if state == "DONE":
                    self._done(req_id)
                    if not engine.read_once:
                        engine.read_once = True
                        logger.info("NIXL: reads from engine %s go over %s", remote.engine_id,
                                    ucx_lanes(self._ucx_log, self.engine_id))
                elif state != "PROC":
                    raise _EngineFailure(f"the NIXL READ ended in state {state}")
            except Exception as e:  # fails this request, or every request of its producer
                reason = (f"could not read its KV from the prefill instance "
                          f"{remote.engine_id} at {remote.host}:{remote.port}: {e}")
                if isinstance(e, _EngineFailure):
                    self._fail_engine(remote.engine_id, reason)
                else:
                    self._done(req_id, reason)

    def _claim_then_post(self, engine: _RemoteEngine, pending: _Load, granted: bool | None
                         ) -> None:
        """Claim the request's blocks (the first claim wins, so params read once are
        refused: blocks the producer may have reused are never read); once granted,
        post the READ. Raises when refused or unanswered."""
        remote = pending.load.remote
        if not pending.claim_deadline:
            engine.claims.send(remote.engine_id, remote.request_id)
            pending.claim_deadline = time.monotonic() + self.liveness_timeout_s
            return
        if granted is False:
            raise RuntimeError(f"it no longer holds the blocks of request "
                               f"{remote.request_id!r} (another reader took them, or they "
                               "were freed)")
        if granted is None:
            if time.monotonic() > pending.claim_deadline:
                raise _EngineFailure(f"it did not answer the claim of its blocks in "
                                     f"{self.liveness_timeout_s:.0f} s")
            return
        load, num_layers = pending.load, len(self.layers)
        local = block_indices(num_layers, next(iter(self.layers.values()))[3],
                              load.local_block_ids)
        remote_ids = block_indices(num_layers, next(iter(engine.layers.values()))[3],
                                   load.remote_block_ids)
        handle = self.agent.make_prepped_xfer("READ", self.local_dlist, local, engine.dlist,
                                              remote_ids, remote.request_id.encode())
        state = self.agent.transfer(handle)
        if state not in ("PROC", "DONE"):
            self.agent.release_xfer_handle(handle)
            raise _EngineFailure(f"posting the NIXL READ gave state {state}")
        pending.handle = handle

    def _check_alive(self, engine: _RemoteEngine, remote: RemotePrefill) -> None:
        """Raise unless the producer beat recently, as the same engine, at the request's
        epoch, with the request's lease not expired."""
        beat = engine.heartbeat  # polled at the start of `_progress`
        silent = time.monotonic() - beat.last_seen
        if beat.engine_id not in (None, remote.engine_id):
            raise _EngineFailure(f"another engine ({beat.engine_id}) answers there now "
                                 "(the prefill instance restarted)")
        if silent > self.liveness_timeout_s:
            raise _EngineFailure(f"it sent no heartbeat for {silent:.1f} s (it died or hangs)")
        if remote.epoch is not None and beat.epoch not in (None, remote.epoch):
            raise RuntimeError(f"it no longer holds the blocks of request "
                               f"{remote.request_id!r} (it went to sleep since)")
        if remote.expires_at is not None and time.time() > remote.expires_at - LEASE_MARGIN_S:
            raise RuntimeError(f"it no longer holds the blocks of request "
                               f"{remote.request_id!r} (its {self.abort_timeout_s:.0f} s "
                               "hold expired)")

    def _remote_engine(self, remote: RemotePrefill) -> _RemoteEngine | None:
        """The producer's agent and prepared list; None while its handshake runs.

        A handshake made before the producer's current epoch (it slept and
        registered its memory again: new keys) is made again.

        Raises:
            RuntimeError / TimeoutError: the handshake failed.
        """
        engine = self._remotes.get(remote.engine_id)
        if engine is not None:
            epoch = engine.heartbeat.epoch
            if epoch in (None, engine.epoch) or remote.epoch not in (None, epoch):
                return engine  # current; or the request is older than its epoch: it fails
            logger.info("NIXL: engine %s registered its KV memory again (epoch %d -> %d); "
                        "handshaking again", remote.engine_id, engine.epoch,
                        engine.heartbeat.epoch)
            self._forget_remote(remote.engine_id)
        future = self._handshakes.get(remote.engine_id)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="nixl-handshake")
            self._handshakes[remote.engine_id] = self._pool.submit(
                fetch_handshake, remote.host, remote.port)
            return None
        if not future.done():
            return None
        del self._handshakes[remote.engine_id]
        try:
            reply, heartbeat = future.result()
        except Exception as e:
            raise _EngineFailure(str(e) or type(e).__name__) from e
        try:
            engine = self._add_remote(remote, reply, heartbeat)
        except BaseException:
            heartbeat.close()
            raise
        self._remotes[remote.engine_id] = engine
        return engine

    def _add_remote(self, remote: RemotePrefill, reply: dict, beat: HeartbeatMonitor
                    ) -> _RemoteEngine:
        if reply["engine_id"] != remote.engine_id:
            raise _EngineFailure(
                f"{remote.host}:{remote.port} is engine {reply['engine_id']}, not "
                f"{remote.engine_id} (the prefill instance restarted?)")
        layers = {k: tuple(v) for k, v in reply["layers"].items()}
        if set(layers) != set(self.layers):
            raise RuntimeError("the prefill instance serves a model with other layers")
        for name, (*_, page, _n) in layers.items():
            if page != self.layers[name][2]:
                raise RuntimeError(f"layer {name}: the prefill instance's blocks are {page} "
                                   f"bytes, here {self.layers[name][2]}")
        name = self.agent.add_remote_agent(base64.b64decode(reply["agent_metadata"]))
        name = name.decode() if isinstance(name, bytes) else name
        start = time.perf_counter()
        dlist = self.agent.prep_xfer_dlist(name, strided_rows(layers, reply["device_id"]),
                                           self.mem_type)
        logger.info("NIXL: handshake with engine %s at %s:%d (epoch %d): %d descriptors "
                    "prepared in %.1f ms", remote.engine_id, remote.host, remote.port,
                    reply.get("epoch", 0), sum(n for *_, n in layers.values()),
                    (time.perf_counter() - start) * 1e3)
        return _RemoteEngine(name, layers, int(reply.get("epoch", 0)), dlist, beat,
                             ClaimClient(remote.host, remote.port))

    def _done(self, req_id: str, reason: str | None = None) -> None:
        """The load ended: done, or failed for `reason`."""
        self._release(self._pending.pop(req_id))
        if reason is None:
            self._recving.add(req_id)
        else:
            self._failed[req_id] = reason

    def _fail_engine(self, engine_id: str, reason: str) -> None:
        """Fail every load from the producer `engine_id` and forget it (its next
        request handshakes again)."""
        for req_id, pending in list(self._pending.items()):
            if pending.load.remote.engine_id == engine_id:
                self._done(req_id, reason)
        self._forget_remote(engine_id)

    def _release(self, pending: _Load) -> None:
        try:
            if pending.handle is not None:
                self.agent.release_xfer_handle(pending.handle)
        except Exception as e:  # a READ still running cannot always be released
            logger.warning("NIXL: releasing a READ handle failed: %s", e)
        pending.handle = None

    def _forget_remote(self, engine_id: str) -> None:
        if (engine := self._remotes.pop(engine_id, None)) is None:
            return
        engine.heartbeat.close()
        engine.claims.close()
        try:
            self.agent.release_dlist_handle(engine.dlist)
            self.agent.remove_remote_agent(engine.agent_name)
        except Exception:  # best effort: it may be half-known
            logger.debug("removing remote agent %s failed", engine.agent_name)

    def wait_for_save(self) -> None:  # the consumer reads; the producer has nothing to push
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Sends confirmed by a consumer's notification (or timed out); loads done."""
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
        if self._pending:
            self._progress()
        recving, self._recving = self._recving, set()
        return sending, recving

    def get_failed_recving(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    def shutdown(self) -> None:
        """Stop the side channel, drop remote agents, deregister (before the memory goes)."""
        if self._side_channel is not None:
            self._side_channel.close()
            self._side_channel = None
        if self.role == KVConnectorRole.SCHEDULER:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for pending in self._pending.values():
            self._release(pending)
        for engine_id in list(self._remotes):
            self._forget_remote(engine_id)
        self._deregister()
        if self._ucx_log is not None and os.path.exists(self._ucx_log):
            os.unlink(self._ucx_log)

    # --------------------------------------------------------- scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[str, Any] | None) -> None:
        """The worker's agent; a producer starts its side channel here (engine core
        process), beside the scheduler, whose sleeps its heartbeat announces. After a
        wake the worker's new metadata (its next epoch) replaces what it serves."""
        self.engine_id = metadata["engine_id"]
        self.epoch = int(metadata.get("epoch", 0))
        if self.kv_role == "kv_consumer":
            return
        if self._side_channel is None:
            self._side_channel = SideChannel(
                self.host, self.port, lambda: self._handshake,
                lambda: {"engine_id": self.engine_id, "epoch": self.epoch}, self._claim)
            self.port = self._side_channel.port
            logger.info("NIXL side channel of engine %s on %s:%d (heartbeat on port %d)",
                        self.engine_id, self.host, self.port, self._side_channel.heartbeat_port)
        import json

        self._handshake = json.dumps(
            {**metadata, "heartbeat_port": self._side_channel.heartbeat_port}).encode()

    def _claim(self, engine_id: str, req_id: str) -> bool:
        """A reader takes a request's blocks: True once (the side channel's thread)."""
        if engine_id != self.engine_id:
            return False
        try:
            self._held.remove(req_id)  # one C call: atomic under the GIL
        except KeyError:
            return False
        return True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._held.difference_update(connector_output.finished_sending)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """A request sent by the proxy with a prefill's params: its prompt is external,
        loaded in the background (load_async)."""
        remote = self._remote_prefill(request)
        if remote is None:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        remote = self._remote_prefill(request)
        if remote is None:
            return
        self._consumed.add(request.request_id)
        first = _num_hit_blocks(blocks)  # the local prefix-cache hit: not read again
        end = -(-(first * self.block_size + num_external_tokens) // self.block_size)
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
        """A prefill for a remote decode keeps its blocks and says where they are, in
        which epoch, and until when."""
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
            "remote_request_id": request.request_id, "remote_epoch": self.epoch,
            "remote_expires_at": time.time() + self.abort_timeout_s,
        }


def _num_hit_blocks(blocks: list[KVCacheBlock]) -> int:
    """Leading blocks that came from the prefix cache (they carry a hash; new ones do not)."""
    return next((i for i, b in enumerate(blocks) if b.block_hash is None), len(blocks))
