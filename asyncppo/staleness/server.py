"""Admission tickets over ZeroMQ: an :class:`AdmissionServer` (ROUTER, a thread in the learner process) in front
of an :class:`~asyncppo.staleness.controller.AdmissionController`, and one :class:`AdmissionClient` (DEALER) per
rollout worker.

Why long-polling: a worker that asks while the pool is exhausted is *parked* on the server and answered as soon
as a ticket frees up (version bump or release), so workers neither spin nor sleep-and-retry. The server thread
wakes every ``poll_ms`` to re-check the controller, because the learner changes its version from another thread.

Messages are small msgpack maps (never pickle), validated field by field; a malformed request is counted in
``rejected`` and ignored. Tickets never leak silently:

* a client whose ``acquire`` times out sends ``cancel``; if the grant crossed the cancel on the wire, the client
  receives a ticket it no longer wants and sends it back with ``release``;
* the ROUTER is ``ROUTER_MANDATORY``: a grant that cannot be delivered (the worker is gone) is released at once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Optional

import zmq

from asyncppo.staleness.controller import AdmissionController, Ticket
from asyncppo.stream.endpoints import bind_socket
from asyncppo.stream.wire import REASONS, WireError, decode_message, encode_message

log = logging.getLogger(__name__)

REQUEST_SPEC = {
    "acquire": {"worker_id": int, "req": int},
    "cancel": {"worker_id": int, "req": int},
    "release": {"worker_id": int, "index": int},
}
REPLY_SPEC = {
    "ticket": {"req": int, "index": int, "min_version": int},
    "stop": {"req": int},
}


class AdmissionServer:
    """Serves tickets from ``controller`` on ``bind_address``; runs in a daemon thread until :meth:`close`."""

    def __init__(
        self,
        controller: AdmissionController,
        bind_address: str = "tcp://127.0.0.1:0",
        context: Optional[zmq.Context] = None,
        poll_ms: int = 5,
    ):
        self.controller = controller
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = bind_socket(self._sock, bind_address)
        self._poll_ms = poll_ms
        self._pending: collections.deque[tuple[bytes, int, int]] = collections.deque()  # (identity, worker, req)
        self.rejected: dict[str, int] = {r: 0 for r in REASONS}
        self.undeliverable = 0
        self.granted_by_worker: collections.Counter[int] = collections.Counter()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="admission-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                if self._sock.poll(self._poll_ms):
                    self._handle_all()
                self._serve_pending()
        finally:
            self._sock.close()

    def _handle_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._reject(WireError("malformed", f"{len(frames)} frames, expected identity + one message"))
                continue
            identity, payload = frames
            try:
                kind, f = decode_message(payload, REQUEST_SPEC, max_bytes=4096)
            except WireError as e:
                self._reject(e)
                continue
            if kind == "acquire":
                self._pending.append((identity, f["worker_id"], f["req"]))
            elif kind == "cancel":
                self._pending = collections.deque(
                    p for p in self._pending if not (p[0] == identity and p[2] == f["req"])
                )
            else:  # release of a grant the client did not want any more
                try:
                    self.controller.release(f["index"])
                except ValueError as e:
                    self._reject(WireError("schema", str(e)))

    def _serve_pending(self) -> None:
        while self._pending:
            identity, worker, req = self._pending[0]
            if self.controller.stopped:
                self._pending.popleft()
                self._send(identity, encode_message("stop", req=req))
                continue
            ticket = self.controller.try_acquire()
            if ticket is None:
                return
            self._pending.popleft()
            msg = encode_message("ticket", req=req, index=ticket.index, min_version=ticket.min_version)
            if self._send(identity, msg):
                self.granted_by_worker[worker] += 1
            else:
                self.controller.release(ticket)

    def _send(self, identity: bytes, msg: bytes) -> bool:
        try:
            self._sock.send_multipart([identity, msg], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self.undeliverable += 1
            log.warning("admission reply to %r undeliverable: %s", identity, e)
            return False

    def _reject(self, err: WireError) -> None:
        self.rejected[err.reason] += 1
        log.warning("rejected admission request: %s", err)

    # ------------------------------------------------------------------------------------------ control
    def stop(self) -> None:
        """Tell every waiting and future client to stop (the controller grants nothing more)."""
        self.controller.stop()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._closing.set()
        self._thread.join()


class AdmissionClient:
    """A worker's handle on the admission server. Not thread-safe: one per worker thread/process."""

    _ids = itertools.count()

    def __init__(self, address: str, worker_id: int, context: Optional[zmq.Context] = None):
        self.worker_id = int(worker_id)
        self._sock = (context if context is not None else zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.connect(address)
        self._req = 0
        self._open: set[int] = set()  # requests sent with request() and not yet answered
        self.stopped = False
        self.rejected: dict[str, int] = {r: 0 for r in REASONS}
        self._early: list[Ticket] = []  # grants for request() that a blocking acquire() read first
        self.returned = 0  # grants that arrived after their request was given up, and were released

    def acquire(self, timeout_s: Optional[float] = None) -> Optional[Ticket]:
        """Block (sleeping in ``poll``) until the server grants a ticket. None when the server says stop or
        ``timeout_s`` passes first."""
        if self.stopped:
            return None
        self._req += 1
        req = self._req
        self._sock.send(encode_message("acquire", worker_id=self.worker_id, req=req))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left_ms = 1000 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                self._sock.send(encode_message("cancel", worker_id=self.worker_id, req=req))
                return None
            if not self._sock.poll(min(left_ms, 1000)):
                continue
            reply = self._recv_reply()
            if reply is None:
                continue
            kind, f = reply
            if kind == "stop":
                self.stopped = True
                return None
            if f["req"] == req:
                return Ticket(index=f["index"], min_version=f["min_version"])
            if f["req"] in self._open:  # a grant for an earlier request(): keep it for poll_granted()
                self._open.discard(f["req"])
                self._early.append(Ticket(index=f["index"], min_version=f["min_version"]))
                continue
            self._give_back(f["index"])  # a grant for a request we already abandoned

    # ------------------------------------------------------------------------------------------------ non-blocking
    def request(self, count: int = 1) -> None:
        """Ask for ``count`` more tickets without waiting for them: the server parks each request until a ticket
        is free, and the grants arrive through :meth:`poll_granted`. Lets a worker keep its engine stepping
        while tickets are on their way (a round trip per ticket would stall every decode step)."""
        if self.stopped:
            return
        for _ in range(max(0, int(count))):
            self._req += 1
            self._open.add(self._req)
            self._sock.send(encode_message("acquire", worker_id=self.worker_id, req=self._req))

    @property
    def open_requests(self) -> int:
        """Requests sent with :meth:`request` and not answered yet."""
        return len(self._open)

    def poll_granted(self, timeout_s: float = 0.0) -> list[Ticket]:
        """The tickets granted so far for :meth:`request`; waits up to ``timeout_s`` for the first one if none
        has arrived. Sets :attr:`stopped` when the server says stop (open requests are then void)."""
        out, self._early = self._early, []
        if not out and self._open and timeout_s > 0:
            self._sock.poll(int(timeout_s * 1000))
        while True:
            reply = self._recv_reply()
            if reply is None:
                return out
            kind, f = reply
            if kind == "stop":
                self.stopped = True
                self._open.clear()
                return out
            if f["req"] in self._open:
                self._open.discard(f["req"])
                out.append(Ticket(index=f["index"], min_version=f["min_version"]))
            else:
                self._give_back(f["index"])

    def release(self, ticket: Ticket) -> None:
        """Give back a granted ticket that will not be used (so its slot is granted again)."""
        self._give_back(ticket.index)

    def _recv_reply(self):
        try:
            payload = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return decode_message(payload, REPLY_SPEC, max_bytes=4096)
        except WireError as e:
            self.rejected[e.reason] += 1
            log.warning("rejected admission reply: %s", e)
            return None

    def _give_back(self, index: int) -> None:
        self._sock.send(encode_message("release", worker_id=self.worker_id, index=index))
        self.returned += 1

    def close(self) -> None:
        """Return any grant that arrived after its request was abandoned, then close."""
        if self._sock.closed:
            return
        for req in sorted(self._open):
            self._sock.send(encode_message("cancel", worker_id=self.worker_id, req=req))
        self._open.clear()
        for ticket in self._early:
            self._give_back(ticket.index)
        self._early = []
        while True:
            reply = self._recv_reply()
            if reply is None:
                break
            if reply[0] == "ticket":
                self._give_back(reply[1]["index"])
        self._sock.close()
