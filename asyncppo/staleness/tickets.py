"""The admission-ticket protocol: the messages an :class:`~asyncppo.staleness.server.AdmissionServer` and its
:class:`~asyncppo.staleness.client.AdmissionClient` exchange, stated once for both ends.

Each message is a small msgpack map built and checked by :mod:`asyncppo.stream.framing` against the exact field
types below; anything else is refused and counted.
"""

from __future__ import annotations

REQUEST_SPEC = {
    # ``count`` tickets, requests ``req`` .. ``req + count - 1``: a worker's whole demand in one message, so the
    # fair rule sees it at once (asked one message at a time, a burst could arrive split, and a greedy worker
    # already waiting took the free tickets before the rest of the newcomer's demand was read).
    "acquire": {"worker_id": int, "req": int, "count": int},
    "cancel": {"worker_id": int, "req": int},
    "release": {"worker_id": int, "index": int},
    # a client whose socket was re-created (stream/redial.py) takes over what its previous connection held:
    # ``previous`` is that connection's routing id, a secret the client chose (server module docstring, "Reattach")
    "reattach": {"worker_id": int, "previous": bytes},
}
REPLY_SPEC = {
    "ticket": {"req": int, "index": int, "min_version": int},
    "stop": {"req": int},
    # after a reattach: a grant the previous connection holds, re-sent (it may have been lost with that connection)
    "held": {"req": int, "index": int, "min_version": int},
}
#: Refusals of the admission server beyond the wire decoder's REASONS.
ADMISSION_REASONS = ("not_holder", "pending_full", "reattach", "retired")
#: libzmq drops the connection of a peer whose message exceeds this (requests and replies are < 100 bytes).
MAXMSGSIZE = 4096
MAX_REPLY_INT = 1 << 53  # sane upper bound for indices and versions in replies
#: A client's routing id: a fixed prefix (never a zero byte: libzmq reserves those for ids it makes) and this many
#: random bytes, the secret that proves a reattach comes from the connection's owner.
ROUTING_SECRET_BYTES = 16
MAX_ROUTING_ID = 255  # libzmq's limit on a routing id
