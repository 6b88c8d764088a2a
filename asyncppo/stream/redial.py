"""Re-creating a connecting socket that libzmq has given up on.

Why this exists. libzmq reconnects a connecting socket by itself after a *connection* error (the peer went away,
the link dropped), but not after a *protocol* error: a frame over the socket's ZMQ_MAXMSGSIZE (which is what a
half-written frame's length field on a flaky link looks like), a malformed ZMTP frame or a failed handshake make it
close the connection and end the session for good. The socket then has no peer for the rest of the process and
says nothing: a worker's control SUB kept reading its last state for the rest of the run, and an admission DEALER
queued its next request for nobody.

How it is told apart. The socket monitor reports both kinds as DISCONNECTED (or HANDSHAKE_FAILED_*), but after an
ordinary drop libzmq schedules the reconnect at once and reports CONNECT_RETRIED; after a protocol error nothing
follows. So a disconnect that no retry follows within ``grace_s`` means the connection was given up, and
:class:`Redialer` closes the socket and makes a new one with its owner's factory (same address, options and CURVE
keys), counting it in ``reconnects``. An ordinary drop is left to libzmq (no new socket, nothing counted), so a
DEALER keeps its identity and whatever it had queued. Redials back off (doubling up to ``max_backoff_s``, reset by
:meth:`Redialer.healthy` when a valid message arrives), so a peer that breaks every connection costs little.

Each monitor listens on its own inproc address (a counter, never reused): pyzmq's default name is built from the
socket's file descriptor, which a socket made right after closing the old one may get again while libzmq's reaper
still holds the old name.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

#: The connection is gone (an ordinary drop too, until a retry is reported).
_DOWN = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
#: libzmq is reconnecting by itself (or has a working connection): nothing to do. CONNECTED is not here: a TCP
#: connection may still fail its handshake.
_UP = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED

_names = itertools.count()

#: How a rollout worker reports its clients' re-created sockets: deltas of their ``reconnects`` since its previous
#: group (or segment), in that record's timings under these keys (rollout/meter.py, ``LinkCounters``); the learner
#: logs their sums over a step's records as ``rollout/<key>`` (docs/staleness.md, "What to watch").
RECONNECT_KEYS = ("reconnects_admission", "reconnects_control")


class Redialer:
    """Owns one connecting socket and re-creates it when libzmq has given its connection up (see the module).

    ``make()`` returns a configured, *unconnected* socket (options, CURVE keys); the redialer attaches its monitor
    before connecting, so a protocol error on the very first connection is seen too. ``on_redial`` runs after each
    new socket is connected (a client re-sends there what the lost connection was answering). Not thread-safe,
    like the socket it owns."""

    def __init__(self, make: Callable[[], zmq.Socket], address: str, what: str, grace_s: float = 0.5,
                 min_backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 on_redial: Optional[Callable[[], None]] = None):
        self._make, self.address, self.what = make, address, what
        self.grace_s, self._min_backoff, self._max_backoff = grace_s, min_backoff_s, max_backoff_s
        self.on_redial = on_redial
        self.reconnects = 0  # sockets re-created after libzmq gave their connection up
        self._down_since: Optional[float] = None  # when a disconnect with no retry after it was seen
        self._backoff = min_backoff_s
        self._last_redial = -math.inf
        self._failed = False  # the last redial could not make its socket (tried again when the backoff allows)
        self.sock, self._monitor = self._open()

    def _open(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self._make()
        name = f"inproc://asyncppo-redial-{os.getpid()}-{next(_names)}"
        sock.monitor(name, _DOWN | _UP)
        monitor = sock.context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(name)
        sock.connect(self.address)
        return sock, monitor

    def _shut(self, linger_ms: Optional[int]) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.sock.close(linger=linger_ms)

    @property
    def closed(self) -> bool:
        return self.sock.closed

    def healthy(self) -> None:
        """A valid message arrived: the next redial, if any, may come at once again."""
        self._backoff = self._min_backoff

    def check(self) -> bool:
        """Read the monitor's events; re-create the socket if its connection was given up. True if it was (the
        old socket and anything still queued on it are gone)."""
        if self.sock.closed:  # closed by close(), or a redial that could not make its socket: retried when due
            if not self._failed or time.monotonic() < self._last_redial + self._backoff:
                return False
            return self._redial()
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event & _UP:
                self._down_since = None
            elif event & _DOWN and self._down_since is None:
                self._down_since = time.monotonic()
        if self._down_since is None or time.monotonic() < self._due():
            return False
        return self._redial()

    def _due(self) -> float:
        return max(self._down_since + self.grace_s, self._last_redial + self._backoff)

    def _redial(self) -> bool:
        """Replace the socket; False if the new one could not be made (out of file descriptors, ...): the socket
        stays closed and :meth:`check` tries again after the backoff, so a wait on it sleeps instead of spinning."""
        if not self.sock.closed:
            self._shut(0)
        self._down_since = None
        self._last_redial = time.monotonic()
        self._backoff = min(2 * self._backoff, self._max_backoff)
        try:
            self.sock, self._monitor = self._open()
        except (zmq.ZMQError, OSError) as e:
            self._failed = True
            log.warning("%s: could not re-create the socket to %s (%s); trying again in %.1fs", self.what,
                        self.address, e, self._backoff)
            return False
        self._failed = False
        self.reconnects += 1
        log.warning("%s: libzmq gave up the connection to %s (a frame over the size limit or a broken handshake); "
                    "re-created the socket (%d so far)", self.what, self.address, self.reconnects)
        if self.on_redial is not None:
            self.on_redial()
        return True

    def poll(self, timeout_ms: int, flags: int = zmq.POLLIN) -> bool:
        """Like ``sock.poll``: whether the socket is ready for ``flags`` within ``timeout_ms``; meanwhile it also
        wakes for the monitor's events and redials a connection given up, so a wait never outlasts its peer."""
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while True:
            self.check()
            if self.sock.closed:
                if not self._failed or time.monotonic() >= deadline:
                    return False
                time.sleep(max(0.0, min(deadline - time.monotonic(), 0.1)))  # no socket yet: wait, never spin
                continue
            poller = zmq.Poller()
            poller.register(self.sock, flags)
            poller.register(self._monitor, zmq.POLLIN)
            wake = deadline if self._down_since is None else min(deadline, self._due())
            ready = dict(poller.poll(max(0, math.ceil((wake - time.monotonic()) * 1000))))
            if ready.get(self.sock, 0) & flags:
                return True
            if time.monotonic() >= deadline:
                return False

    def close(self, linger_ms: Optional[int] = None) -> None:
        self._failed = False  # closed for good: no more redials
        if not self.sock.closed:
            self._shut(linger_ms)


class RedialingClient:
    """What a client whose socket a :class:`Redialer` owns exposes: ``_sock``, the socket of the moment (never
    keep it: a redial replaces it), and ``reconnects``, for the worker's metrics next to ``rejected``."""

    _redial: Redialer

    @property
    def _sock(self) -> zmq.Socket:
        return self._redial.sock

    @property
    def reconnects(self) -> int:
        """Sockets re-created after libzmq gave the connection up (an oversized or broken frame)."""
        return self._redial.reconnects
