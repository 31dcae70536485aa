"""NixlConnector's side channel: the handshake and the producer's heartbeat (ZMQ).

    producer (engine core process, beside the scheduler)   consumer (worker process)
      SideChannel                                            handshake(host, port)
        ROUTER host:port     "handshake" -> metadata  <----    once per producer (in a
                             (agent metadata, layers,          background thread: no
                              heartbeat port, epoch)           step waits for it)
                             "claim" req -> 1 | 0     <----  ClaimClient (DEALER): sent
                             (1 once: the first claim          before each READ, answered
                              takes the blocks)                between two steps
        PUB  host:hb_port    every HEARTBEAT_S:       ---->  HeartbeatMonitor (SUB, the
                             {engine_id, epoch, seq}          latest beat only), polled
                                                              between steps: liveness
                                                              without a round trip

Why: a consumer must not promote a request whose KV it read from blocks the
producer no longer held. The claim makes each request's blocks readable once
(a replayed or copied `kv_transfer_params` is refused, even by another
consumer, before it reads anything). It is the one round trip before a READ
(~0.2 ms on one host, inside the consumer's 1 ms poll); sent beside the READ
it raced the READ's own completion notice, which frees the blocks.
The heartbeat tells every reader at once that a producer is gone (no new beat
within the liveness timeout; a restarted producer beats with another engine
id) or slept (its epoch changed: new memory keys, no blocks kept), before a
READ is posted. Block expiry is the lease in the request's
`kv_transfer_params` (`remote_expires_at`), checked locally.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

HEARTBEAT_S = 0.05  # a producer beats this often (seconds)
HANDSHAKE_TIMEOUT_S = 5.0


class SideChannel:
    """The producer's side: a ROUTER socket answering handshakes and claims, and a PUB
    socket beating (both on one thread).

    Args:
        host, port: where the ROUTER socket binds (port 0: a free one; see `port`).
        handshake: returns the handshake reply (bytes), called per query.
        beat: returns the heartbeat's fields (engine_id, epoch), called per beat.
        claim: (engine id, request id) -> whether that request's blocks are still
            held and were not claimed before (the first True takes them).
    """

    def __init__(self, host: str, port: int, handshake: Callable[[], bytes],
                 beat: Callable[[], dict[str, Any]], claim: Callable[[str, str], bool]
                 ) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._rep = self._ctx.socket(zmq.ROUTER)
        self._rep.setsockopt(zmq.LINGER, 0)
        if port:
            self._rep.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._rep.bind_to_random_port(f"tcp://{host}")
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.heartbeat_port = self._pub.bind_to_random_port(f"tcp://{host}")
        self._handshake, self._beat, self._claim = handshake, beat, claim
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._seq += 1
                self._pub.send(json.dumps({**self._beat(), "seq": self._seq}).encode())
                next_beat = now + HEARTBEAT_S
            while self._rep.poll(max(1, int((next_beat - now) * 1000)), zmq.POLLIN):
                ident, _, *query = self._rep.recv_multipart()
                try:
                    reply = self._answer(query)
                except Exception:  # a failing answer must not stop the channel
                    logger.exception("NIXL side channel: answering %r failed", query[:2])
                    reply = [b"{}"]
                self._rep.send_multipart([ident, b"", *reply])
                now = time.monotonic()
                if now >= next_beat:
                    break
        self._rep.close()
        self._pub.close()

    def _answer(self, query: list[bytes]) -> list[bytes]:
        if query == [b"handshake"]:
            return [self._handshake()]
        if len(query) == 3 and query[0] == b"claim":
            granted = self._claim(query[1].decode(), query[2].decode())
            return [b"claim", query[2], b"1" if granted else b"0"]
        return [b"{}"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._ctx.term()


def handshake(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """Ask a producer's side channel for its handshake metadata (one round trip).

    Raises:
        TimeoutError: nobody answered within `timeout_s`.
    """
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(b"handshake")
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no answer from its side channel {host}:{port} in "
                               f"{timeout_s:.0f} s (is it running?)")
        return json.loads(sock.recv())
    finally:
        sock.close()


class ClaimClient:
    """The consumer's claims on one producer (DEALER): sent, answered asynchronously."""

    def __init__(self, host: str, port: int) -> None:
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{host}:{port}")

    def send(self, engine_id: str, request_id: str) -> None:
        self._sock.send_multipart([b"", b"claim", engine_id.encode(), request_id.encode()])

    def answers(self) -> dict[str, bool]:
        """Request id -> granted, for every answer that arrived (never blocks)."""
        import zmq

        out: dict[str, bool] = {}
        while True:
            try:
                _, kind, req_id, granted = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if kind == b"claim":
                out[req_id.decode()] = granted == b"1"

    def close(self) -> None:
        self._sock.close()


class HeartbeatMonitor:
    """The consumer's view of one producer's heartbeat (SUB, only the newest beat kept).

    Args:
        host, heartbeat_port: the producer's PUB socket (from its handshake).

    Attributes:
        engine_id, epoch: of the newest beat (None before the first).
        last_seen: `time.monotonic()` of the poll that first saw the newest beat.
    """

    def __init__(self, host: str, heartbeat_port: int) -> None:
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.CONFLATE, 1)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(f"tcp://{host}:{heartbeat_port}")
        self.engine_id: str | None = None
        self.epoch: int | None = None
        self._seq = -1
        self.last_seen = time.monotonic()  # a fresh connection gets the liveness timeout

    def poll(self) -> None:
        """Take the newest beat, if one arrived since the last poll (never blocks)."""
        import zmq

        try:
            beat = json.loads(self._sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return
        if beat["seq"] != self._seq or beat["engine_id"] != self.engine_id:
            self._seq, self.last_seen = beat["seq"], time.monotonic()
        self.engine_id, self.epoch = beat["engine_id"], int(beat["epoch"])

    def wait_first(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for the first beat (handshake thread only)."""
        import zmq

        if self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            self.poll()
        return self.engine_id is not None

    def close(self) -> None:
        self._sock.close()


def fetch_handshake(host: str, port: int) -> tuple[dict, HeartbeatMonitor]:
    """The producer's handshake reply and a monitor that saw its first beat (a thread)."""
    reply = handshake(host, port, HANDSHAKE_TIMEOUT_S)
    beat = HeartbeatMonitor(host, int(reply["heartbeat_port"]))
    if not beat.wait_first(HANDSHAKE_TIMEOUT_S):
        beat.close()
        raise TimeoutError(f"no heartbeat from {host}:{reply['heartbeat_port']} in "
                           f"{HANDSHAKE_TIMEOUT_S:.0f} s")
    return reply, beat


def log_ucx_endpoints() -> str | None:
    """Have UCX log its endpoint configurations to a file of ours (when the user set no
    UCX log level), so the transport it picks per peer can be named; its path or None."""
    path = os.path.join(tempfile.gettempdir(), f"vllm-ucx-{os.getpid()}.log")
    if os.environ.get("UCX_LOG_FILE") == path:
        return path  # another agent of this process set it
    if "UCX_LOG_LEVEL" in os.environ or "UCX_LOG_FILE" in os.environ:
        return None
    os.environ["UCX_LOG_LEVEL"] = "info"
    os.environ["UCX_LOG_FILE"] = path
    return path


def ucx_lanes(log_path: str | None, agent_name: str) -> str:
    """The lanes of the last endpoint UCX configured for `agent_name` toward a peer,
    from its log (e.g. "UCX rma_bw(cuda_ipc/cuda) ..." or "UCX rma_am(tcp/lo) ..."),
    or "UCX (transport not logged)"."""
    unknown = "UCX (transport not logged)"
    if log_path is None or not os.path.exists(log_path):
        return unknown
    import ctypes

    ctypes.CDLL(None).fflush(None)  # UCX's log file is a buffered C stream
    prefix = agent_name[:31]  # UCX logs the worker's name truncated
    with open(log_path, errors="replace") as f:
        lines = [line for line in f if " cfg#" in line and f" {prefix} " in line
                 and " self cfg#" not in line]
    if not lines:
        return unknown
    lanes = lines[-1].split(" cfg#", 1)[1].split(None, 1)
    return "UCX " + " ".join(lanes[1].split()) if len(lanes) > 1 else unknown
