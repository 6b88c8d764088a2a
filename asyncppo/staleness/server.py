"""Admission tickets over ZeroMQ: an :class:`AdmissionServer` (ROUTER, a thread in the learner process) in front
of an :class:`~asyncppo.staleness.controller.AdmissionController`, and one :class:`AdmissionClient` (DEALER) per
rollout worker (:mod:`asyncppo.staleness.client`; the messages both speak are in :mod:`asyncppo.staleness.tickets`).

Why long-polling: a worker that asks while the pool is exhausted is *parked* on the server and answered as soon
as a ticket frees up (version bump or release), so workers neither spin nor sleep-and-retry. The server thread
sleeps in one poll on its socket and on a wake-up pipe, which is written by whatever may free a ticket from
another thread: the controller's changes (a version bump, a release, stop; :meth:`AdmissionController.add_listener`),
a group's arrival (:meth:`AdmissionServer.claim`: its worker holds one ticket fewer), a retirement and ``close``.
``poll_ms`` is only a safety net. Why not a short timer: the thread shares the learner's interpreter, and waking
it 200 times a second (the timer it replaced) takes the GIL from the update as often.

Messages are small msgpack maps (never pickle), validated field by field; a malformed request is counted in
``rejected`` and ignored. Tickets never leak silently:

* a client whose ``acquire`` times out sends ``cancel``; if the grant crossed the cancel on the wire, the client
  receives a ticket it no longer wants and sends it back with ``release``;
* the ROUTER is ``ROUTER_MANDATORY``: a grant that cannot be delivered (the worker is gone) is released at once.

Who holds what. Every grant is recorded with the connection (ROUTER identity) and worker id it went to, until the
worker's group arrives (:meth:`AdmissionServer.claim`, called by the learner's content validator) or the ticket
comes back. So a ticket can be released only over the connection that holds it, a group is accepted only for a
ticket its worker holds (once), and ``held_by`` can list a dead worker's tickets. Each connection may *hold* at most
``max_tickets_per_peer`` tickets: requests beyond that are parked (served once its groups arrive), never refused, so
a worker under backpressure is only slowed. Who of several waiting connections gets a free ticket is max-min fair by
tickets held (:mod:`asyncppo.staleness.fairness`), so one engine with a large ``max_num_seqs`` cannot take the whole
window while another idles; ``fair_tickets=False`` keeps arrival order, for comparison. The pending queue is bounded
per connection and in total, and requests beyond those bounds are refused and counted. Nothing a peer sends raises:
every refusal is a count in ``rejected``. Replies are range-checked on the client too.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

import zmq

from asyncppo.staleness.controller import AdmissionController
from asyncppo.staleness.fairness import HoldingClock, next_holder, startup_cap
from asyncppo.staleness.tickets import ADMISSION_REASONS, MAXMSGSIZE, REQUEST_SPEC
from asyncppo.stream.endpoints import bind_socket
from asyncppo.stream.errors import REASONS, WireError
from asyncppo.stream.framing import decode_message, encode_message
from asyncppo.stream.security import CurveKeys, ServerSecurity

log = logging.getLogger(__name__)


@dataclass
class _Grant:
    identity: bytes
    worker_id: int
    min_version: int


class AdmissionServer:
    """Serves tickets from ``controller`` on ``bind_address``; runs in a daemon thread until :meth:`close`."""

    def __init__(
        self,
        controller: AdmissionController,
        bind_address: str = "tcp://127.0.0.1:0",
        context: Optional[zmq.Context] = None,
        poll_ms: int = 200,
        max_tickets_per_peer: Optional[int] = None,
        max_pending: int = 1024,
        curve: Optional[CurveKeys] = None,
        fair_tickets: bool = True,
        expected_workers: Optional[int] = None,
    ):
        self.controller = controller
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAXMSGSIZE)
        self._security = ServerSecurity(curve)
        self._security.apply(self._sock)
        self.address = bind_socket(self._sock, bind_address)
        self._poll_ms = poll_ms
        if max_tickets_per_peer is not None and max_tickets_per_peer < 1:
            raise ValueError(f"max_tickets_per_peer must be >= 1 or None, got {max_tickets_per_peer}")
        self.max_tickets_per_peer = max_tickets_per_peer
        self.max_pending = max(1, int(max_pending))
        self.fair_tickets = bool(fair_tickets)  # False: arrival order (the rule before fair tickets, for comparison)
        self.expected_workers = expected_workers  # fair_tickets: an equal share each until this many have asked
        self._asked: set[int] = set()
        self._last_served: dict[bytes, int] = {}  # connection -> grant count when it was last served (ties)
        self.holding = HoldingClock()  # per worker: seconds holding >= 1 ticket (its engine has work)
        self._pending: collections.deque[tuple[bytes, int, int]] = collections.deque()  # (identity, worker, req)
        self._lock = threading.Lock()  # grants/held: the server thread writes, the learner's feeder claims
        self._grants: dict[int, _Grant] = {}  # granted, not yet delivered as a group, not released
        self._held: collections.Counter[bytes] = collections.Counter()
        self.rejected: dict[str, int] = {r: 0 for r in REASONS + ADMISSION_REASONS}
        self.undeliverable = 0
        self.granted_by_worker: collections.Counter[int] = collections.Counter()
        self._closing = threading.Event()
        self._retiring: collections.deque = collections.deque()  # (worker_id, done event, tickets returned)
        # the wake-up pipe: any thread writes a byte (os.write is thread-safe, unlike a ZeroMQ socket); made after
        # the argument checks, so a refused setting leaves no pipe open and no listener on the controller
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()  # the write end is closed under it, so no write hits a reused fd
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        controller.add_listener(self._wake)
        self._thread = threading.Thread(target=self._run, name="admission-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                events = dict(self._poller.poll(self._poll_ms))
                if self._wake_r in events:
                    self._drain_wake()
                if self._sock in events:
                    self._handle_all()
                self._serve_retiring()
                self._serve_pending()
        finally:
            self._sock.close()

    def _wake(self) -> None:
        """Make the server thread re-check now (any thread). A full pipe means a wake-up is already pending."""
        with self._wake_lock:
            if self._wake_w < 0:  # closed: the server is gone
                return
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # full: a wake-up is already due (or the thread has left: nothing to wake)
                pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

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
            try:
                self._dispatch(identity, kind, f)
            except Exception as e:  # a request that passed its checks and still broke its handler: refused and
                log.exception("admission request %s from %r failed", kind, identity)  # counted; the server lives on
                self._reject(WireError("malformed", f"{kind}: {type(e).__name__}: {e}"))

    def _dispatch(self, identity: bytes, kind: str, f: dict) -> None:
        if kind == "acquire":
            self._park(identity, f["worker_id"], f["req"], f["count"])
        elif kind == "cancel":
            self._pending = collections.deque(
                p for p in self._pending if not (p[0] == identity and p[2] == f["req"])
            )
        else:  # release of a grant the client did not want any more: only its holder may
            with self._lock:
                g = self._grants.get(f["index"])
                if g is None or g.identity != identity:
                    self._count("not_holder", f"release of ticket {f['index']} by {identity!r}")
                    return
                self._forget_locked(f["index"])
            self.controller.release(f["index"])

    def _park(self, identity: bytes, worker: int, first: int, count: int) -> None:
        """Park requests ``first .. first + count - 1`` of one connection, as far as ``max_pending`` and the
        per-connection limit allow; the rest are refused and counted as ``pending_full`` (a well-behaved worker asks
        for its free engine slots, far below both limits: only a flood reaches them)."""
        if count < 1:
            self._count("schema", f"acquire from {identity!r}: count {count} < 1")
            return
        mine = sum(1 for p in self._pending if p[0] == identity)
        room = min(self.max_pending - len(self._pending), self._peer_limit() - mine)
        if room < count:
            self._count("pending_full", f"acquire of {count} from {identity!r}: {mine} pending from it, "
                                        f"{len(self._pending)} in all")
        for req in range(first, first + max(0, min(room, count))):
            self._pending.append((identity, worker, req))
        if room > 0:
            self.holding.seen(worker)
            self._asked.add(worker)

    def _peer_limit(self) -> int:
        return self.max_tickets_per_peer if self.max_tickets_per_peer is not None else self.max_pending

    def _forget_locked(self, index: int) -> _Grant:
        g = self._grants.pop(index)
        self.holding.add(g.worker_id, -1)
        self._held[g.identity] -= 1
        if self._held[g.identity] <= 0:
            del self._held[g.identity]
        return g

    def _serve_pending(self) -> None:
        """Answer parked requests: each free ticket to the waiting connection holding fewest (``fair``, see
        :mod:`asyncppo.staleness.fairness`), or in arrival order (``fair=False``); never past a connection's cap."""
        if not self._pending:
            return
        if self.controller.stopped:
            while self._pending:
                identity, _, req = self._pending.popleft()
                self._send(identity, encode_message("stop", req=req))
            return
        queues: dict[bytes, collections.deque] = {}  # per connection: (arrival position, worker, req)
        for pos, (identity, worker, req) in enumerate(self._pending):
            queues.setdefault(identity, collections.deque()).append((pos, worker, req))
        served: set[tuple[bytes, int]] = set()
        while queues:
            identity = self._pick(queues)
            if identity is None:
                break  # every waiting connection is at its holding limit
            ticket = self.controller.try_acquire()
            if ticket is None:
                break
            _, worker, req = queues[identity].popleft()
            if not queues[identity]:
                del queues[identity]
            served.add((identity, req))
            self._last_served[identity] = self.controller.granted
            self._grant(identity, worker, req, ticket)
        if served:
            self._pending = collections.deque(p for p in self._pending if (p[0], p[2]) not in served)

    def _pick(self, queues: dict) -> Optional[bytes]:
        """The connection the next ticket goes to; its oldest parked request is served."""
        limit = self.max_tickets_per_peer
        if self.fair_tickets:  # ties: the connection served least recently, then the oldest request (round-robin)
            by_turn = sorted(queues, key=lambda i: (self._last_served.get(i, -1), queues[i][0][0]))
            window = self.controller.window()  # (j + 1) * B tickets in flight
            return next_holder(by_turn, self._held,
                               startup_cap(window, self.expected_workers, len(self._asked), limit))
        by_age = sorted(queues, key=lambda identity: queues[identity][0][0])
        return next((i for i in by_age if limit is None or self._held[i] < limit), None)  # arrival order

    def _grant(self, identity: bytes, worker: int, req: int, ticket) -> None:
        with self._lock:
            self._grants[ticket.index] = _Grant(identity, worker, ticket.min_version)
            self._held[identity] += 1
            self.holding.add(worker, +1)
        msg = encode_message("ticket", req=req, index=ticket.index, min_version=ticket.min_version)
        if self._send(identity, msg):
            self.granted_by_worker[worker] += 1
        else:
            with self._lock:
                self._forget_locked(ticket.index)
            self.controller.release(ticket)

    # ------------------------------------------------------------------------------------------ ledger
    def claim(self, index: int, worker_id: int, version_min: int) -> Optional[str]:
        """The group of ticket ``index`` arrived from ``worker_id`` (see :class:`asyncppo.stream.validate.TicketLedger`):
        None if that worker holds the ticket and ``version_min`` honours its ``min_version`` (the ticket is then
        delivered: a second group for it is refused), else the reason."""
        with self._lock:
            g = self._grants.get(index)
            if g is None or not self.controller.is_outstanding(index):
                return "ticket"
            if g.worker_id != worker_id:
                return "worker"
            if version_min < g.min_version:
                return "version"
            self._forget_locked(index)
        self._wake()  # its worker holds one ticket fewer: a request parked at its holding limit may be served
        return None

    def forfeit(self, index: int, worker_id: int) -> bool:
        """Give back a ticket still held by ``worker_id`` whose group was refused, so the slot is granted again."""
        with self._lock:
            g = self._grants.get(index)
            if g is None or g.worker_id != worker_id:
                return False
            self._forget_locked(index)
        return self.controller.release(index)

    def retire(self, worker_id: int, timeout_s: float = 10.0) -> list[int]:
        """Worker ``worker_id``'s process died (the launcher restarts it): drop its parked requests and give every
        ticket it held back to the pool; returns those tickets. The server thread does it (it owns the parked
        queue), before it serves anyone again, so no ticket is granted to the dead connection afterwards."""
        done, box = threading.Event(), []
        self._retiring.append((int(worker_id), done, box))
        self._wake()
        if not done.wait(timeout_s):
            raise TimeoutError(f"the admission server did not retire worker {worker_id} within {timeout_s}s")
        return box

    def _serve_retiring(self) -> None:
        while self._retiring:
            worker_id, done, box = self._retiring.popleft()
            self._pending = collections.deque(p for p in self._pending if p[1] != worker_id)
            box.extend(i for i in self.held_by(worker_id) if self.forfeit(i, worker_id))
            done.set()

    def held_by(self, worker_id: int) -> list[int]:
        """Tickets granted to ``worker_id`` whose groups have not arrived (what a dead worker leaves behind)."""
        with self._lock:
            return sorted(i for i, g in self._grants.items() if g.worker_id == worker_id)

    def _send(self, identity: bytes, msg: bytes) -> bool:
        try:
            self._sock.send_multipart([identity, msg], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self.undeliverable += 1
            log.warning("admission reply to %r undeliverable: %s", identity, e)
            return False

    def _reject(self, err: WireError) -> None:
        self._count(err.reason, str(err))

    def _count(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        log.debug("rejected admission request: %s: %s", reason, detail)  # summarised by the learner

    # ------------------------------------------------------------------------------------------ control
    def stop(self) -> None:
        """Tell every waiting and future client to stop (the controller grants nothing more)."""
        self.controller.stop()
        self.holding.freeze()

    def summary(self) -> dict:
        """For summary.json: the ticket rule, grants and busy fraction (:class:`HoldingClock`) per worker."""
        return {"fair_tickets": self.fair_tickets, "granted_by_worker": dict(sorted(self.granted_by_worker.items())),
                "busy_by_worker": self.holding.busy_fractions()}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._closing.set()
        self._wake()
        self._thread.join()
        with self._wake_lock:
            if self._wake_w >= 0:  # a second close has nothing left to close
                os.close(self._wake_w)
                os.close(self._wake_r)
                self._wake_w = -1
        self._security.release()
