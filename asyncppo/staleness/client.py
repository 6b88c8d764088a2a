"""A rollout worker's handle on the admission server (:mod:`asyncppo.staleness.server`): ``acquire`` blocks for one
ticket, ``request`` / ``poll_granted`` keep several in flight without blocking. Replies are range-checked here too:
nothing the server sends is trusted: a bad one is counted and skipped, and the replies behind it are still read. A
grant that arrives after its request was given up is sent back at once, so no ticket leaks.

A reply over MAXMSGSIZE makes libzmq drop the connection for good (a protocol error, never reconnected), and every
later request went to nobody. The socket is owned by a :class:`~asyncppo.stream.redial.Redialer`, which re-creates it
(same address and keys, counted in ``reconnects``). The new connection then *reattaches* (the server's module
docstring states the rule): every socket gets a routing id of its own, ``asyncppo-w<worker>-`` and 16 random bytes
(``ZMQ_ROUTING_ID``), and the first message on a new socket is ``reattach`` naming the previous one's, which only
this client and the server know; the server moves the old connection's grants and parked requests to the new one
and re-sends each grant as ``held``. Then the requests still unanswered are asked again (the server skips those it
has moved; asked in case the reattach was refused). A ``held`` grant is sorted by what this client knows of it:

* its request is still open (or is the one a blocking ``acquire`` waits for): the grant was lost with the old
  connection; it is taken like any grant (counted in ``redelivered``);
* its request was given up (a timed-out ``acquire``'s cancel crossed the grant), or the ticket was given back since
  this client last received it (that release may have been lost with the old connection): given back (again);
* otherwise this client received it and holds it (or has sent its group): ignored.

Without the reattach, a grant lost in the broken frame or held from the old connection stayed with that connection
on the server (a release is taken only from the holder): it was never used, and it stalled the learner, which
trains tickets in order, until the worker was retired.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import time
from typing import Optional

import zmq

from asyncppo.staleness.controller import Ticket
from asyncppo.staleness.tickets import MAX_REPLY_INT, MAXMSGSIZE, REPLY_SPEC, ROUTING_SECRET_BYTES
from asyncppo.stream.errors import REASONS, WireError
from asyncppo.stream.framing import decode_message, encode_message
from asyncppo.stream.redial import Redialer, RedialingClient
from asyncppo.stream.security import CurveKeys, apply_client

# earlier connections a re-created socket names in its reattaches, at most (a link breaking that often is down)
MAX_REATTACH = 4
log = logging.getLogger(__name__)

#: How many given-up requests and given-back tickets a client remembers, to sort ``held`` grants (module
#: docstring). Both are rare (a timed-out acquire, a duplicate or late grant); the oldest are forgotten first.
_MEMORY = 4096


class AdmissionClient(RedialingClient):
    """A worker's handle on the admission server. Not thread-safe: one per worker thread/process."""

    _ids = itertools.count()

    def __init__(self, address: str, worker_id: int, context: Optional[zmq.Context] = None,
                 curve: Optional[CurveKeys] = None):
        self.worker_id = int(worker_id)
        ctx = context if context is not None else zmq.Context.instance()
        # this socket's routing id and the previous one's, and whether the server knows them (an acquire or a
        # reattach was sent on them): a reattach names the previous one only then (module docstring)
        self._rid: Optional[bytes] = None
        self._known = False
        # earlier connections whose grants may still be recorded against them on the server, newest first: each one
        # on which something was sent since the last valid reply. A reattach is only known to have been read once a
        # reply arrives on its socket; a socket that dies before that would otherwise strand its predecessor's
        # grants (the next socket named a connection the server never heard of), so every candidate is named
        # until a reply confirms the chain (the server refuses, and counts, the names it no longer knows)
        self._candidates: list[bytes] = []

        def make() -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 200)
            sock.setsockopt(zmq.MAXMSGSIZE, MAXMSGSIZE)
            rid = f"asyncppo-w{self.worker_id}-".encode() + secrets.token_bytes(ROUTING_SECRET_BYTES)
            sock.setsockopt(zmq.ROUTING_ID, rid)
            apply_client(sock, curve)
            if self._known and self._rid is not None:
                self._candidates = [self._rid, *self._candidates][:MAX_REATTACH]
            self._rid, self._known = rid, False
            return sock

        self._req = 0
        self._open: set[int] = set()  # requests sent with request() and not yet answered
        self._waiting: Optional[int] = None  # the request a blocking acquire() waits for
        self._abandoned: collections.OrderedDict[int, None] = collections.OrderedDict()  # requests given up
        self._gave_back: collections.OrderedDict[int, None] = collections.OrderedDict()  # tickets given back last
        self._redial = Redialer(make, address, f"admission client of worker {self.worker_id}",
                                on_redial=self._ask_again)
        self.stopped = False
        self.rejected: dict[str, int] = {r: 0 for r in REASONS}
        self._early: list[Ticket] = []  # grants for request() that a blocking acquire() read first
        self.returned = 0  # grants that arrived after their request was given up, and were released
        self.reattaches = 0  # reattach messages sent after a re-created socket
        self.redelivered = 0  # grants lost with an old connection and taken after the reattach

    def acquire(self, timeout_s: Optional[float] = None) -> Optional[Ticket]:
        """Block (sleeping in ``poll``) until the server grants a ticket. None when the server says stop or
        ``timeout_s`` passes first."""
        if self.stopped:
            return None
        self._req += 1
        req = self._req
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._send_acquire(req, 1, deadline):
            return None
        self._waiting = req  # asked again if the connection is re-created while we wait
        try:
            return self._await_grant(req, deadline)
        finally:
            self._waiting = None

    def _await_grant(self, req: int, deadline: Optional[float]) -> Optional[Ticket]:
        while True:
            left_ms = 1000 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                self._send_nowait(encode_message("cancel", worker_id=self.worker_id, req=req))
                _remember(self._abandoned, req)
                return None
            if not self._redial.poll(min(left_ms, 1000)):
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
        count = max(0, int(count))
        if self.stopped or not count:
            return
        first = self._req + 1
        self._req += count
        self._send_acquire(first, count, None)
        self._open.update(range(first, first + count))  # after the send: a redial during it asks only the older

    def _send_acquire(self, first: int, count: int, deadline: Optional[float]) -> bool:
        sent = self._send_within(encode_message("acquire", worker_id=self.worker_id, req=first, count=count),
                                 deadline)
        self._known |= sent  # the server knows this connection now: a later socket may reattach to it
        return sent

    def _ask_again(self) -> None:
        """The socket was re-created: reattach to the previous connection (module docstring), then ask again, on
        the new connection, for every request still unanswered (the server skips those it moved over with the
        reattach; a grant that still arrives twice for one request is given back like any grant nobody waits
        for)."""
        msgs = [encode_message("reattach", worker_id=self.worker_id, previous=rid) for rid in self._candidates]
        reattaches = len(msgs)
        reqs = sorted(self._open | ({self._waiting} if self._waiting is not None else set()))
        msgs += [encode_message("acquire", worker_id=self.worker_id, req=first, count=count)
                 for first, count in _runs(reqs)]
        for i, msg in enumerate(msgs):
            try:  # the new socket queues until it connects (never blocks: we are inside a wait)
                self._sock.send(msg, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("admission client of worker %d: could not reattach or ask again (%d messages lost)",
                            self.worker_id, len(msgs) - i)
                return
            self._known = True  # the server knows this connection once it reads any of these messages
            if i < reattaches:
                self.reattaches += 1

    @property
    def open_requests(self) -> int:
        """Requests sent with :meth:`request` and not answered yet."""
        return len(self._open)

    def poll_granted(self, timeout_s: float = 0.0) -> list[Ticket]:
        """The tickets granted so far for :meth:`request`; waits up to ``timeout_s`` for the first one if none
        has arrived. Sets :attr:`stopped` when the server says stop (open requests are then void)."""
        out, self._early = self._early, []
        if not out and self._open and timeout_s > 0:
            self._redial.poll(int(timeout_s * 1000))
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
        """The next valid reply queued, or None when none is. A bad one is counted and skipped: returning None for
        it, as before, made close() stop there, so a grant queued behind it was never given back."""
        while True:
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                kind, f = decode_message(payload, REPLY_SPEC, max_bytes=MAXMSGSIZE)
                if not 0 < f["req"] <= self._req or (kind != "stop" and not (
                        0 <= f["index"] < MAX_REPLY_INT and 0 <= f["min_version"] < MAX_REPLY_INT)):
                    raise WireError("schema", f"{kind} reply out of range: {f} (requests sent: {self._req})")
            except WireError as e:
                self.rejected[e.reason] += 1
                log.warning("rejected admission reply: %s", e)
                continue
            self._redial.healthy()
            self._candidates = []  # a reply on this socket: the server read its first message, the reattaches
            if kind == "stop":
                return kind, f
            wanted = f["req"] in self._open or f["req"] == self._waiting
            if kind == "held":  # re-sent after a reattach (module docstring)
                if wanted:
                    self.redelivered += 1
                elif f["req"] in self._abandoned or f["index"] in self._gave_back:
                    self._abandoned.pop(f["req"], None)
                    self._give_back(f["index"])
                    continue
                else:
                    continue  # received on the old connection and held (or its group sent): nothing to do
            if wanted:
                self._gave_back.pop(f["index"], None)  # ours again: a later ``held`` of it is not a lost release
            else:
                self._abandoned.pop(f["req"], None)  # the caller gives it back
            return "ticket", f

    def _give_back(self, index: int) -> None:
        self._send_nowait(encode_message("release", worker_id=self.worker_id, index=index))
        _remember(self._gave_back, index)
        self.returned += 1

    def _send_within(self, msg: bytes, deadline: Optional[float]) -> bool:
        """Send ``msg`` once a server is connected, or give up at ``deadline`` (``time.monotonic()``; None: wait
        as long as it takes). A DEALER with no connected peer (the server not up, or our CURVE handshake refused)
        cannot send, and a refused handshake drops the peer at any moment, so a socket polled writable may have
        none by the time it sends: a blocking send after the poll hung a refused client for good (seen in the
        auth test). So every try is non-blocking, and the waits between tries are polls bounded by the deadline.
        A connection libzmq gave up is re-created first, so the message goes to the server, not into the void."""
        self._redial.check()
        while True:
            try:
                self._sock.send(msg, zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
            wait_ms = 1000 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if wait_ms <= 0:
                return False
            self._redial.poll(min(wait_ms, 1000), zmq.POLLOUT)

    def _send_nowait(self, msg: bytes) -> bool:
        """Cancels and releases never block: with no connected server (gone, or our handshake refused) there is
        nothing to cancel, and a grant the server cannot deliver is released on its side."""
        return self._send_within(msg, deadline=time.monotonic())  # one try, no wait

    def close(self) -> None:
        """Return every grant queued (past any bad reply among them) and any that arrived after its request was
        abandoned, then close."""
        if self._sock.closed:
            return
        for req in sorted(self._open):
            self._send_nowait(encode_message("cancel", worker_id=self.worker_id, req=req))
            _remember(self._abandoned, req)
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
        self._redial.close()


def _remember(memory: collections.OrderedDict, key: int) -> None:
    """Note ``key`` as the newest entry of a bounded memory (``_MEMORY``), forgetting the oldest beyond it."""
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > _MEMORY:
        memory.popitem(last=False)


def _runs(reqs: list[int]) -> list[tuple[int, int]]:
    """Sorted request numbers as ``(first, count)`` runs of consecutive ones: one ``acquire`` message each."""
    out: list[tuple[int, int]] = []
    for r in reqs:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out
