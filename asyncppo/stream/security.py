"""ZeroMQ CURVE authentication for the learner's sockets: per-run keys, server and client setup, the ZAP check.

Why CURVE, and when. On loopback only processes of this machine can connect, so by default (``cluster.auth=auto``)
the sockets stay plain there. A multi-node run binds beyond loopback, and then anyone who can reach the port could
push trajectories, take every ticket or read the control state. CURVE (libzmq's elliptic-curve handshake and
encryption) closes that: a client must know the server's public key to complete the handshake at all, and the
learner's ZAP handler (:class:`_Gate`, a ``zmq.auth`` thread on the learner's context) admits only the run's client
public key. Both key pairs are generated per run by the launcher (:meth:`CurveKeys.generate`) and travel to the
workers with the endpoints through Ray (never over the sockets they protect); nothing is written to disk.
``cluster.auth=curve`` forces it on (also on loopback, which is how the tests exercise it), ``off`` turns it off.

One client key pair is shared by all workers of a run: the keys authenticate *membership of the run*; which worker
holds which ticket is tracked per connection by the admission server, not by key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator

from asyncppo.config.hosts import is_loopback  # the loopback rule is stated once, in config/

AUTH_MODES = ("auto", "curve", "off")
_DOMAIN = "*"


def auth_enabled(mode: str, bind_address: str) -> bool:
    """Whether the learner's sockets use CURVE: ``curve`` always, ``off`` never, ``auto`` beyond loopback."""
    if mode not in AUTH_MODES:
        raise ValueError(f"auth mode {mode!r} not allowed; allowed: {AUTH_MODES}")
    return mode == "curve" or (mode == "auto" and not is_loopback(bind_address))


@dataclass(frozen=True)
class CurveKeys:
    """A run's CURVE keys as Z85 text (40 characters each). ``server_secret`` is None in the workers' copy."""

    server_public: str
    client_public: str
    client_secret: str
    server_secret: Optional[str] = None

    @classmethod
    def generate(cls) -> "CurveKeys":
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE support; cluster.auth=curve cannot work "
                               "(install pyzmq's bundled libzmq, or keep cluster.bind_address on loopback)")
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        return cls(spub.decode(), cpub.decode(), csec.decode(), ssec.decode())

    def for_workers(self) -> "CurveKeys":
        """The copy handed to rollout workers: no server secret."""
        return replace(self, server_secret=None)

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r}, ...)"


class _Gate:
    """The ZAP handler of one context: admits the client public keys registered by the servers living on it.

    libzmq asks the handler (over ``inproc://zeromq.zap.01``) for every CURVE handshake on a socket of that context;
    one handler per context, shared by the sockets on it, started before the first server binds and stopped when
    the last one closes (a running handler would keep ``Context.term()`` from returning)."""

    _lock = threading.Lock()
    _by_context: dict[int, "_Gate"] = {}

    def __init__(self, context: zmq.Context):
        self.allowed: dict[str, int] = {}
        self.denied = 0
        self.users = 0
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve_callback(_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key.decode(errors="replace") in self.allowed
        if not ok:
            self.denied += 1
        return ok

    @classmethod
    def attach(cls, context: zmq.Context, client_public: str) -> "_Gate":
        with cls._lock:
            gate = cls._by_context.get(id(context))
            if gate is None:
                gate = cls._by_context[id(context)] = cls(context)
            gate.users += 1
            gate.allowed[client_public] = gate.allowed.get(client_public, 0) + 1
            return gate

    @classmethod
    def detach(cls, context: zmq.Context, client_public: str) -> None:
        with cls._lock:
            gate = cls._by_context.get(id(context))
            if gate is None:
                return
            left = gate.allowed.get(client_public, 0) - 1
            if left > 0:
                gate.allowed[client_public] = left
            else:
                gate.allowed.pop(client_public, None)
            gate.users -= 1
            if gate.users <= 0:
                del cls._by_context[id(context)]
                gate.auth.stop()


class ServerSecurity:
    """What a binding socket does with the run's keys: CURVE server before bind, undone on close."""

    def __init__(self, keys: Optional[CurveKeys]):
        if keys is not None and keys.server_secret is None:
            raise ValueError("a CURVE server needs the server secret key (the learner's copy of CurveKeys)")
        self.keys = keys
        self._context: Optional[zmq.Context] = None

    def apply(self, sock: zmq.Socket) -> None:
        """Call before ``bind``. No-op without keys."""
        k = self.keys
        if k is None:
            return
        self._context = sock.context
        _Gate.attach(sock.context, k.client_public)
        sock.curve_secretkey = k.server_secret.encode()
        sock.curve_publickey = k.server_public.encode()
        sock.curve_server = True

    def release(self) -> None:
        """Call after the socket closed."""
        if self._context is not None and self.keys is not None:
            _Gate.detach(self._context, self.keys.client_public)
            self._context = None


def denied_handshakes(context: Optional[zmq.Context] = None) -> int:
    """Handshakes the context's ZAP handler refused (an unknown client key), for metrics and tests."""
    ctx = context if context is not None else zmq.Context.instance()
    gate = _Gate._by_context.get(id(ctx))
    return gate.denied if gate is not None else 0


def apply_client(sock: zmq.Socket, keys: Optional[CurveKeys]) -> None:
    """Make a connecting socket a CURVE client of the run's server (call before ``connect``). No-op without keys."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_secretkey = keys.client_secret.encode()
