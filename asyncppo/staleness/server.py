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

Reattach: what a re-created client socket takes over. A client whose connection libzmq gave up (a frame over its
size limit or broken on the link: :mod:`asyncppo.stream.redial`) makes a new socket, and so a new connection with a
new identity; the grants and parked requests of the old one stayed recorded against it, so a grant lost with the
broken frame was never used, never released (only its holder may) and stalled the learner, which trains tickets in
order, until the worker was retired. So each client names its connections itself: a routing id of a readable prefix
and 16 random bytes (``ZMQ_ROUTING_ID``, new for every socket), which only the client and this server see (the
handshake carries it: encrypted under CURVE; without CURVE whoever reads the link reads it, as it reads everything
else, docs/security.md). The rule:

* a ``reattach`` from connection N naming connection O (``previous``) is taken only when O is a connection this
  server knows (it asked for tickets, or was reattached to), O is not N, and O and N (if N is known) belong to the
  ``worker_id`` the message names. Knowing O's routing id is the proof: a worker id is public (it is in every group
  id), the id's random bytes are not, so another peer naming a worker's id, or a made-up or stale identity, gets
  nothing; it is refused and counted in ``rejected["reattach"]``, like every bad message;
* taken, every grant and parked request of O is moved to N (holding counts and fair-share turn with them), O is
  forgotten (a second reattach naming it is refused), a message still arriving over O counts as N's, and every grant
  N now holds from O is re-sent as a ``held`` reply with its request number: the client takes the ones it never
  received, ignores the ones it holds and gives back the ones it had given up (tickets.py, client.py);
* an ``acquire`` of a request its connection already has parked or granted is not parked twice (the client asks
  again for its open requests after the reattach, in case it was refused).

The server lets a connection's routing id be taken over by a new connection (``ROUTER_HANDOVER``): a client's
ordinary reconnect, which libzmq makes itself under the same routing id, is then served at once even while the dead
connection is not yet noticed, and with its grants (nothing moves: the identity is the same). Routing ids are never
logged whole (:func:`_label`). Beyond ``max_known_peers`` known connections, the oldest that hold and park nothing
are forgotten (a reattach naming one is then refused; nothing is lost with it); one with tickets never is.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

import zmq

from asyncppo.staleness.controller import AdmissionController
from asyncppo.staleness.fairness import HoldingClock, next_holder, startup_cap
from asyncppo.staleness.tickets import (ADMISSION_REASONS, MAX_ROUTING_ID, MAXMSGSIZE, REQUEST_SPEC,
                                        ROUTING_SECRET_BYTES)
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
    req: int  # the request it answered, re-sent with it after a reattach


def _label(identity: bytes) -> str:
    """A connection as logs name it: a client's routing id ends in random bytes that prove a reattach (module
    docstring), so only its prefix and a short hash are shown."""
    if len(identity) <= ROUTING_SECRET_BYTES:  # not one of our clients' (libzmq's own ids are 5 bytes)
        return repr(identity)
    return f"{identity[:-ROUTING_SECRET_BYTES]!r}#{hashlib.blake2b(identity, digest_size=4).hexdigest()}"


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
        max_known_peers: int = 4096,
    ):
        self.controller = controller
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnect under the same routing id (module docstring)
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
        self._reqs: dict[bytes, dict[int, int]] = {}  # connection -> {request: ticket index} of its grants
        # connections that asked (or were reattached to) -> the worker id they asked as; only these may be named by
        # a reattach. Bounded: beyond max_known_peers the oldest holding and parking nothing are forgotten.
        self._known: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.max_known_peers = max(1, int(max_known_peers))
        self._moved: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # reattached: old -> new
        self.reattached = 0  # reattaches taken
        self.resent = 0  # grants re-sent after a reattach
        self.rejected: dict[str, int] = {r: 0 for r in REASONS + ADMISSION_REASONS}
        self.undeliverable = 0
        self.granted_by_worker: collections.Counter[int] = collections.Counter()
        self._closing = threading.Event()
        self._retiring: collections.deque = collections.deque()  # (worker_id, done event, tickets returned)
        # connections of retired workers (bounded, oldest forgotten): refused from then on. A worker retired as hung
        # may still be alive until the launcher's kill lands (a link that came back); a request it sent meanwhile
        # was granted and the ticket died with it, held by nobody, and the learner waited for it until its timeout
        # (the two-host drill's cable pulled past the hang timeout)
        self._retired: collections.OrderedDict[bytes, None] = collections.OrderedDict()
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
                if kind == "reattach" and not 0 < len(f["previous"]) <= MAX_ROUTING_ID:
                    raise WireError("schema", f"reattach: previous routing id of {len(f['previous'])} bytes")
            except WireError as e:
                self._reject(e)
                continue
            identity = self._moved.get(identity, identity)  # a late message of a connection reattached since
            try:
                self._dispatch(identity, kind, f)
            except Exception as e:  # a request that passed its checks and still broke its handler: refused and
                log.exception("admission request %s from %s failed", kind, _label(identity))  # counted; lives on
                self._reject(WireError("malformed", f"{kind}: {type(e).__name__}: {e}"))

    def _dispatch(self, identity: bytes, kind: str, f: dict) -> None:
        if identity in self._retired:
            self._count("retired", f"{kind} from {_label(identity)}, a connection of a retired worker")
            return
        if kind == "acquire":
            self._know(identity, f["worker_id"])
            self._park(identity, f["worker_id"], f["req"], f["count"])
        elif kind == "reattach":
            self._reattach(identity, f["worker_id"], f["previous"])
        elif kind == "cancel":
            self._pending = collections.deque(
                p for p in self._pending if not (p[0] == identity and p[2] == f["req"])
            )
        else:  # release of a grant the client did not want any more: only its holder may
            with self._lock:
                g = self._grants.get(f["index"])
                if g is None or g.identity != identity:
                    self._count("not_holder", f"release of ticket {f['index']} by {_label(identity)}")
                    return
                self._forget_locked(f["index"])
            self.controller.release(f["index"])

    def _park(self, identity: bytes, worker: int, first: int, count: int) -> None:
        """Park requests ``first .. first + count - 1`` of one connection, as far as ``max_pending`` and the
        per-connection limit allow; the rest are refused and counted as ``pending_full`` (a well-behaved worker asks
        for its free engine slots, far below both limits: only a flood reaches them). A request the connection has
        parked or granted already (asked again after a reattach) is skipped."""
        if count < 1:
            self._count("schema", f"acquire from {_label(identity)}: count {count} < 1")
            return
        mine = {p[2] for p in self._pending if p[0] == identity}
        with self._lock:
            known = mine | set(self._reqs.get(identity, ()))
        dup = {r for r in known if first <= r < first + count}
        new = count - len(dup)
        room = min(self.max_pending - len(self._pending), self._peer_limit() - len(mine))
        if room < new:
            self._count("pending_full", f"acquire of {count} from {_label(identity)}: {len(mine)} pending from it, "
                                        f"{len(self._pending)} in all")
        placed, req = 0, first
        while placed < min(room, new):  # at most room + len(dup) passes
            if req not in dup:
                self._pending.append((identity, worker, req))
                placed += 1
            req += 1
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
        reqs = self._reqs.get(g.identity)
        if reqs is not None:
            reqs.pop(g.req, None)
            if not reqs:
                del self._reqs[g.identity]
        return g

    # ------------------------------------------------------------------------------------------ reattach
    def _know(self, identity: bytes, worker: int) -> None:
        """Remember a connection that asked as ``worker`` (the first worker id it named), for a later reattach."""
        if identity not in self._known:
            self._known[identity] = worker
            self._trim_known()

    def _trim_known(self) -> None:
        """Forget the oldest known connections beyond ``max_known_peers`` that hold and park nothing (a connection
        with tickets is never forgotten: its owner may need to reattach to them)."""
        excess = len(self._known) - self.max_known_peers
        if excess <= 0:
            return
        busy = {p[0] for p in self._pending}
        with self._lock:
            busy |= set(self._held)
        for identity in [i for i in self._known if i not in busy][:excess]:
            del self._known[identity]

    def _reattach(self, identity: bytes, worker: int, previous: bytes) -> None:
        """Move every grant and parked request of connection ``previous`` to ``identity`` and re-send the grants
        (module docstring, "Reattach"); refused and counted unless the rule there holds."""
        owner = self._known.get(previous)
        if previous == identity or owner is None or owner != worker or self._known.get(identity, worker) != worker:
            self._count("reattach", f"reattach of {_label(identity)} as worker {worker} naming {_label(previous)}: "
                                    f"{'unknown connection' if owner is None else 'not that worker connection'}")
            return
        del self._known[previous]
        self._known[identity] = worker
        self._moved[previous] = identity
        for old in [o for o, new in self._moved.items() if new == previous]:
            self._moved[old] = identity  # a chain of reattaches: every older connection is the newest's
        while len(self._moved) > self.max_known_peers:
            self._moved.popitem(last=False)
        self._pending = collections.deque((identity if p[0] == previous else p[0], p[1], p[2]) for p in self._pending)
        with self._lock:
            resend = sorted(((i, g) for i, g in self._grants.items() if g.identity == previous), key=lambda x: x[1].req)
            for _, g in resend:
                g.identity = identity
            if previous in self._held:
                self._held[identity] += self._held.pop(previous)
            moved = self._reqs.pop(previous, {})
            if moved:
                self._reqs.setdefault(identity, {}).update(moved)
        if previous in self._last_served:
            self._last_served[identity] = max(self._last_served.pop(previous), self._last_served.get(identity, -1))
        self.reattached += 1
        log.info("admission: worker %d reattached %s to %s; re-sending %d grants", worker, _label(previous),
                 _label(identity), len(resend))
        for index, g in resend:  # kept if undeliverable: the worker may hold it (its group may be on the way)
            if self._send(identity, encode_message("held", req=g.req, index=index, min_version=g.min_version)):
                self.resent += 1

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
            self._grants[ticket.index] = _Grant(identity, worker, ticket.min_version, req)
            self._held[identity] += 1
            self._reqs.setdefault(identity, {})[req] = ticket.index
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
            for identity in [i for i, w in self._known.items() if w == worker_id]:
                del self._known[identity]  # the dead worker's connections: nothing left to reattach to
                self._retired[identity] = None  # ... and nothing more to ask, should it still be alive
            while len(self._retired) > self.max_known_peers:
                self._retired.popitem(last=False)
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
            log.warning("admission reply to %s undeliverable: %s", _label(identity), e)
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
