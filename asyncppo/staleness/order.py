"""Which groups the learner trains next: ticket order, with deferral under an admission lookahead.

Pure logic on ticket indices (no records, sockets or threads), so that the buffer (:mod:`asyncppo.staleness.buffer`)
and the advisor's pipeline simulator (asyncppo/report/simulator.py) apply one and the same rule.
"""

from __future__ import annotations

import heapq
from typing import Protocol


class TicketOrder(Protocol):
    """What ticket-ordered consumption needs from the admission controller."""

    def lowest_outstanding(self, n: int) -> list[int]: ...

    def is_outstanding(self, index: int) -> bool: ...

    def can_defer(self, take: list[int], version: int) -> bool: ...

    def priority(self, index: int) -> tuple[int, int]: ...


def next_batch(order: TicketOrder, arrived, n: int, version: int) -> tuple[list[int], int] | None:
    """The tickets of the batch the learner trains at ``version``, given the tickets that have ``arrived`` (a
    container of indices), and how many of them overtook a missing lower ticket; None if the batch is not ready.

    The rule of ticket-ordered consumption with deferral (the buffer's docstring says why), pure so that the simulator
    (asyncppo/report/simulator.py) replays exactly what the buffer does: the ``n`` lowest outstanding tickets when
    all have arrived; else the ``n`` lowest arrived ones (both by ``order.priority``), if ``order.can_defer`` says every missing ticket still
    meets its deadline."""
    want = order.lowest_outstanding(n)
    if len(want) < n:
        return None
    if all(t in arrived for t in want):
        return want, 0
    # no full sort per call; the order's own key (deadline, index): ascending index unless the window moved
    pool = heapq.nsmallest(n, (t for t in arrived if order.is_outstanding(t)), key=order.priority)
    if len(pool) < n or not order.can_defer(pool, version):
        return None
    lowest = set(want)
    return pool, sum(1 for t in pool if t not in lowest)


def take_startable(pending, version: int):
    """Remove and return the ticket a worker holding weights ``version`` starts next from ``pending`` (a deque of
    granted tickets), or None when none is startable: the lowest index whose ``min_version`` those weights satisfy,
    since the learner trains the lowest outstanding tickets first. Not simply the oldest grant: a released ticket
    granted again (its group was dropped or skipped) has a lower index and may need older weights than tickets
    granted before it, and waiting behind those for weights not pushed yet would hold up the very batch that needs
    it (with pushes every second version, for good)."""
    best = None
    for t in pending:
        if t.min_version <= version and (best is None or t.index < best.index):
            best = t
    if best is not None:
        pending.remove(best)
    return best
