"""ZeroMQ endpoint strings from the ``cluster`` config (``bind_address``, ``*_port``, ``advertise_address``).

Kept apart from the sockets so launch code can compute what workers should connect to without opening anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import zmq

from asyncppo.stream.security import CurveKeys


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_endpoint(host: str = "127.0.0.1", port: int = 0) -> str:
    """``tcp://host:port``; port 0 means "let the OS pick" (ZeroMQ spells that ``*``)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    return f"tcp://{_host(host)}:{port if port else '*'}"


def normalize_bind(address: str) -> str:
    """Accept ``tcp://host:0`` as well as ``tcp://host:*`` for an ephemeral port."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address


def connect_endpoint(bound: str, advertise_host: str | None = None) -> str:
    """What a peer should connect to, given the actual bound endpoint (``socket.LAST_ENDPOINT``).

    A socket bound to a wildcard host (``0.0.0.0``) reports that host; peers need a reachable one instead."""
    if advertise_host is None:
        if "://0.0.0.0:" in bound or "://[::]:" in bound:
            raise ValueError(f"{bound} is bound to a wildcard host; pass advertise_host (cluster.advertise_address)")
        return bound
    scheme, rest = bound.split("://", 1)
    port = rest.rsplit(":", 1)[1]
    return f"{scheme}://{_host(advertise_host)}:{port}"


def bind_socket(sock: zmq.Socket, address: str) -> str:
    """Bind ``sock`` and return the actual endpoint (with the chosen port)."""
    address = normalize_bind(address)
    if address.startswith("tcp://[") :
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(address)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


@dataclass
class Endpoints:
    """Where the learner listens: what the launcher hands every rollout worker (the only wiring the two sides
    share besides the records they stream and the weights they sync)."""

    trajectory: str
    control: str
    admission: str
    sync_host: str
    sync_port: int
    sync_world_size: int
    sync_backend: str = "gloo"  # "nccl" when both the learner and the engines hold GPUs
    # CURVE client keys when the learner's sockets authenticate (cluster.auth), else None; see stream.security
    curve: Optional[CurveKeys] = None
    max_message_bytes: int = 256 << 20  # the trajectory receiver's limit: the sender refuses larger frames
    sync_prefix: str = ""  # per-run secret key prefix of the weight-sync store (sync.group.make_sync_group)
    eval: str = ""  # evaluation reports (stream/evals.py); empty when the run has no held-out set
    # True: one two-rank weight-sync group per worker and incarnation (sync/fanout.py), rank 1 in it; False: one
    # shared group of sync_world_size ranks in which worker w is rank 1 + w
    sync_per_worker: bool = False
