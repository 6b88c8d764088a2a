"""ZeroMQ channels: trajectories worker -> learner (PUSH/PULL) and control state learner -> workers (PUB/SUB).

Why these socket types
----------------------
* PUSH/PULL gives fair-queued, lossless delivery with backpressure: when the learner's buffer is full it stops
  reading, the PULL and PUSH high-water marks fill up, and ``TrajectorySender.send`` blocks. Nothing is dropped
  on the way; only the staleness buffer decides to drop.
* PUB/SUB loses messages to slow or late subscribers. That is harmless here because a control message carries
  the *whole* state (version, weights_version, stop), never a delta, and the publisher repeats the last state
  periodically so a worker that connects late still learns it (the "slow joiner" problem).

Limits and trust. Every socket has a size limit: the trajectory receiver counts a frame over
``max_message_bytes`` as ``oversized`` (and ZMQ_MAXMSGSIZE, a memory guard above it, disconnects a peer whose frame
is grossly larger before it is read in full); the sender refuses to send a frame the receiver would refuse, with
the reason, instead of reporting it sent. A worker's control subscriber whose connection libzmq gives up (a frame
over its limit: a protocol error, never reconnected by libzmq) re-creates its socket (:mod:`asyncppo.stream.redial`)
and counts it in ``reconnects``. Control messages are range-checked, not only type-checked (a
``weights_version`` that can never arrive would make a worker wait forever). Rejections are counted per reason and
logged at debug level; the learner logs one summary line per interval
(:class:`asyncppo.stream.validate.RejectionSummary`). With ``curve`` keys (:mod:`asyncppo.stream.security`) the
binding sockets are CURVE servers and the connecting ones CURVE clients: a peer without the run's keys cannot
complete a handshake, so it can neither push nor listen.

Sockets are not thread-safe; each object owns one socket and guards it with a lock where a background thread
also uses it. Objects share the process-wide ``zmq.Context.instance()`` unless given a context, and ``close()``
uses a short linger so processes and tests exit promptly.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from asyncppo.stream.endpoints import bind_socket
from asyncppo.stream.errors import REASONS, WireError
from asyncppo.stream.framing import decode_message, encode_message
from asyncppo.stream.records import TrajectoryGroup
from asyncppo.stream.redial import Redialer, RedialingClient
from asyncppo.stream.security import CurveKeys, ServerSecurity, apply_client
from asyncppo.stream.wire import decode_group, encode_group

log = logging.getLogger(__name__)

MiB = 1 << 20
#: Small-message sockets (control, subscriptions): libzmq drops the connection of a peer sending more than this.
SMALL_MAXMSGSIZE = 64 * 1024
#: Largest value a version or counter in a control message may take (2^53: exact in a float, far beyond any run).
MAX_COUNTER = 1 << 53


def _ctx(context: Optional[zmq.Context]) -> zmq.Context:
    return context if context is not None else zmq.Context.instance()


class TrajectorySender:
    """Worker side of the trajectory stream (PUSH, connects to the learner's receiver)."""

    def __init__(self, address: str, hwm: int = 64, context: Optional[zmq.Context] = None, linger_ms: int = 1000,
                 max_message_bytes: Optional[int] = None, curve: Optional[CurveKeys] = None):
        self.address = address
        self.linger_ms = linger_ms
        self.max_message_bytes = max_message_bytes  # the receiver's limit: larger frames are refused here
        self._sock = _ctx(context).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        apply_client(self._sock, curve)
        self._sock.connect(address)
        self._timeout_ms: Optional[int] = None
        self.sent = 0
        self.refused = 0

    def _set_timeout(self, timeout_s: Optional[float]) -> None:
        ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000))
        if ms != self._timeout_ms:
            self._sock.setsockopt(zmq.SNDTIMEO, ms)
            self._timeout_ms = ms

    def send(self, group: TrajectoryGroup, timeout_s: Optional[float] = None) -> bool:
        """Encode and send one group. Blocks while the high-water marks are full (backpressure from the learner);
        returns False if ``timeout_s`` passed first (the group was not sent). Encoding errors raise WireError."""
        return self.send_encoded(encode_group(group), timeout_s)

    def send_encoded(self, frame: bytes, timeout_s: Optional[float] = None) -> bool:
        """Send an already encoded frame (lets a caller encode once outside a lock, or measure encoding apart).

        A frame over ``max_message_bytes`` raises ``WireError("oversized")``: the receiver would only count and
        drop it, so reporting it sent would lose the group silently."""
        if self.max_message_bytes is not None and len(frame) > self.max_message_bytes:
            self.refused += 1
            raise WireError("oversized", f"a {len(frame)}-byte group exceeds the learner's limit of "
                                         f"{self.max_message_bytes} bytes (raise cluster.max_message_mb)")
        self._set_timeout(timeout_s)
        try:
            self._sock.send(frame, copy=False)
        except zmq.Again:
            return False
        self.sent += 1
        return True

    def close(self, linger_ms: Optional[int] = None) -> None:
        """Close the socket; unsent messages get ``linger_ms`` (default: the constructor's) to leave, then drop."""
        if not self._sock.closed:
            self._sock.close(linger=self.linger_ms if linger_ms is None else linger_ms)


class TrajectoryReceiver:
    """Learner side of the trajectory stream (PULL, binds).

    Every frame is validated by :func:`decode_group`; a bad one is counted in ``rejected[reason]`` and skipped, so
    one broken or hostile worker cannot stop the stream or make it lose what it already holds.

    ``max_message_bytes`` is the application limit (rejected as ``oversized`` and counted). ZMQ_MAXMSGSIZE is set
    to twice that as a memory guard: libzmq *disconnects* a peer that exceeds it (the message is never seen, and
    whatever that peer had already queued behind it is lost), so it must sit above the counted limit.
    """

    def __init__(
        self,
        bind_address: str = "tcp://127.0.0.1:0",
        hwm: int = 64,
        max_message_bytes: int = 256 * MiB,
        context: Optional[zmq.Context] = None,
        linger_ms: int = 0,
        decode: Optional[Callable] = None,
        curve: Optional[CurveKeys] = None,
    ):
        self.max_message_bytes = int(max_message_bytes)
        # decode(buf, max_bytes) -> record; another record type on this stream (e.g. stream.segments) plugs in here
        self.decode = decode if decode is not None else decode_group
        self._sock = _ctx(context).socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes + MiB)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._security = ServerSecurity(curve)
        self._security.apply(self._sock)
        self.address = bind_socket(self._sock, bind_address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.rejected: dict[str, int] = {r: 0 for r in REASONS}
        self.received = 0
        self.last_error: Optional[WireError] = None

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[TrajectoryGroup]:
        """The next valid group, or None when ``timeout_ms`` passes first (None: wait forever)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            try:
                # Zero-copy receive: the decoded arrays are views into this zmq message, and ``frame.more``
                # answers the multipart question without a getsockopt call per message.
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                if left == 0 and deadline is not None:
                    return None
                if not self._poller.poll(left):
                    return None
                continue
            if frame.more:
                while self._sock.getsockopt(zmq.RCVMORE):  # drain the rest of this multipart message
                    self._sock.recv()
                self._reject(WireError("malformed", "multipart message; a group is one frame"))
                continue
            try:
                group = self.decode(frame.buffer, self.max_message_bytes)
            except WireError as e:
                self._reject(e)
                continue
            self.received += 1
            return group

    def _reject(self, err: WireError) -> None:
        self.rejected[err.reason] += 1
        self.last_error = err
        log.debug("rejected trajectory message: %s", err)  # summarised by the learner, not one line each

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close()
            self._security.release()


# ------------------------------------------------------------------------------------------------ control

_CONTROL_SPEC = {"control": {"version": int, "weights_version": int, "stop": bool, "seq": int, "time": float}}


def check_control(f: dict) -> None:
    """Range checks of a decoded control message (types are already checked): ``0 <= weights_version <= version
    < 2^53``, ``seq >= 0``, ``time`` finite. Raises ``WireError("schema")``."""
    v, w = f["version"], f["weights_version"]
    if not (0 <= w <= v < MAX_COUNTER) or not 0 <= f["seq"] < MAX_COUNTER or not math.isfinite(f["time"]):
        raise WireError("schema", f"control message out of range: version={v}, weights_version={w}, "
                                  f"seq={f['seq']}, time={f['time']} (need 0 <= weights_version <= version < 2^53)")


@dataclass(frozen=True)
class ControlState:
    """What the learner wants every worker to know. Cumulative: the newest state replaces all older ones."""

    version: int  # learner policy version (optimiser steps taken)
    weights_version: int  # newest version whose weights are (being) broadcast
    stop: bool = False
    seq: int = 0  # publisher's message counter, for debugging and ordering
    time: float = 0.0  # unix time of publication


class ControlPublisher:
    """Learner side of the control channel (PUB, binds). Repeats the last state every ``republish_interval_s``."""

    def __init__(
        self,
        bind_address: str = "tcp://127.0.0.1:0",
        republish_interval_s: float = 0.2,
        context: Optional[zmq.Context] = None,
        curve: Optional[CurveKeys] = None,
    ):
        self._sock = _ctx(context).socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, SMALL_MAXMSGSIZE)  # what a PUB receives: subscriptions
        self._security = ServerSecurity(curve)
        self._security.apply(self._sock)
        self.address = bind_socket(self._sock, bind_address)
        self._lock = threading.Lock()
        self._state: Optional[ControlState] = None
        self._seq = 0
        self._closed = threading.Event()
        self._interval = republish_interval_s
        self._thread: Optional[threading.Thread] = None
        if republish_interval_s > 0:
            self._thread = threading.Thread(target=self._republish_loop, name="control-republish", daemon=True)
            self._thread.start()

    @property
    def state(self) -> Optional[ControlState]:
        return self._state

    def publish(self, version: int, weights_version: int, stop: bool = False) -> ControlState:
        """Announce a new state to every subscriber (and remember it for periodic repeats)."""
        if type(version) is not int or type(weights_version) is not int or type(stop) is not bool:
            raise TypeError(
                f"publish(version: int, weights_version: int, stop: bool), got "
                f"({type(version).__name__}, {type(weights_version).__name__}, {type(stop).__name__})"
            )
        with self._lock:
            self._seq += 1
            self._state = ControlState(version, weights_version, stop, self._seq, time.time())
            self._send_locked()
            return self._state

    def republish(self) -> None:
        """Send the last state again (on demand, e.g. right after a worker reports that it joined)."""
        with self._lock:
            self._send_locked()

    def _send_locked(self) -> None:
        s = self._state
        if s is None or self._sock.closed:
            return
        msg = encode_message(
            "control", version=s.version, weights_version=s.weights_version, stop=s.stop, seq=s.seq, time=s.time
        )
        try:
            self._sock.send(msg, zmq.NOBLOCK)  # PUB never blocks; a full subscriber queue just drops
        except zmq.Again:
            pass

    def _republish_loop(self) -> None:
        while not self._closed.wait(self._interval):
            self.republish()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if not self._sock.closed:
                self._sock.close()
                self._security.release()


class ControlSubscriber(RedialingClient):
    """Worker side of the control channel (SUB, connects). Only the newest state matters.

    A frame over SMALL_MAXMSGSIZE makes libzmq drop the connection for good (a protocol error, never reconnected):
    one such frame left a worker reading its old state for the rest of the run. The socket is therefore owned by a
    :class:`~asyncppo.stream.redial.Redialer`, which re-creates it (same address and keys) and counts it in
    ``reconnects``; the publisher's next repeat brings the state back."""

    def __init__(self, address: str, context: Optional[zmq.Context] = None, curve: Optional[CurveKeys] = None):
        ctx = _ctx(context)

        def make() -> zmq.Socket:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, SMALL_MAXMSGSIZE)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            apply_client(sock, curve)
            return sock

        self._redial = Redialer(make, address, "control subscriber")
        self._state: Optional[ControlState] = None
        self.rejected: dict[str, int] = {r: 0 for r in REASONS}

    def _drain(self) -> bool:
        self._redial.check()
        got = False
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            if self._sock.getsockopt(zmq.RCVMORE):
                while self._sock.getsockopt(zmq.RCVMORE):
                    self._sock.recv()
                self.rejected["malformed"] += 1
                continue
            try:
                _, f = decode_message(frame, _CONTROL_SPEC)
                check_control(f)
            except WireError as e:
                self.rejected[e.reason] += 1
                log.debug("rejected control message: %s", e)
                continue
            self._state = ControlState(**f)
            self._redial.healthy()
            got = True

    def latest(self, timeout_ms: int = 0) -> Optional[ControlState]:
        """Drain everything queued and return the newest state known. If none was ever received, wait up to
        ``timeout_ms`` for the first one. None: nothing heard yet."""
        self._drain()
        if self._state is None and timeout_ms > 0:
            deadline = time.monotonic() + timeout_ms / 1000
            while self._state is None:
                left = int((deadline - time.monotonic()) * 1000)
                if left <= 0 or not self._redial.poll(left):
                    break
                self._drain()
        return self._state

    def heard(self, timeout_s: float) -> bool:
        """Whether any control message arrives within ``timeout_s``. The learner repeats its state every 0.2 s, so
        seconds of silence mean it is gone (a worker then awaits a restarted learner: rollout/skeleton.py)."""
        deadline = time.monotonic() + timeout_s
        while not self._drain():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._redial.poll(int(min(remaining, 0.2) * 1000))
        return True

    def wait_for(
        self, predicate: Callable[[ControlState], bool], timeout_s: Optional[float] = None
    ) -> Optional[ControlState]:
        """Block until the newest state satisfies ``predicate`` (e.g. ``lambda s: s.weights_version >= m or
        s.stop``); return it, or None on timeout. Sleeps in ``poll``, never spins."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._drain()
            if self._state is not None and predicate(self._state):
                return self._state
            left = 1000 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                return None
            self._redial.poll(min(left, 1000))

    def close(self) -> None:
        self._redial.close()
