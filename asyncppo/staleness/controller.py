"""Admission control at the source: how far rollout workers may run ahead of the learner.

The rule (docs/architecture.md, "Versions and staleness"): ticket ``i`` (0-based, counted in groups over the
whole run) is granted only while ``i < (k + v + 1) * B`` and carries ``min_version = i // B - k``; the worker
must hold weights of at least that version before it generates. ``v`` is the learner version, ``B`` the number
of groups per learner step, ``k`` the maximum staleness. With ``k = 0`` this is synchronous PPO.

Why it bounds lag. Think of ticket ``i`` as reserving *consumption slot* ``i``: the learner trains on slots
``v*B .. v*B+B-1`` at version ``v``. A group generated with weights ``>= i//B - k`` and trained at version
``i//B`` therefore has lag ``<= k``; if it is trained earlier (it overtook others) its lag is smaller.

Dropped groups. The buffer's lag guard may drop a group (its worker was slow); the learner then returns its
ticket with :meth:`release` so the pool does not shrink. The slot accounting must stay honest after that, so
the controller counts *live* tickets ``L = granted - released`` rather than raw indices:

* a ticket is granted only while ``L < (k + v + 1) * B`` (identical to the rule above when nothing was
  released, since then ``L`` equals the next fresh index);
* a new grant occupies slot ``p = L`` and gets ``min_version = max(0, p // B - k, i // B - k)`` for index ``i``
  (both terms equal ``i // B - k`` when nothing was released). A released index is handed out again first
  (indices stay unique among live tickets, so a trace stays readable), and its min_version is recomputed from
  the slot it now occupies: re-granting a dropped ticket with its old, low min_version would only produce
  another group that is dropped again.

Invariant (checked by the tests): at every moment the number of live tickets is ``<= (k + v + 1) * B``, every
grant's ``min_version >= v - k`` for the learner version ``v`` at grant time (because ``L >= v*B``: all consumed
groups came from live tickets), and a group trained no later than its slot's version has lag ``<= k``. Groups
that arrive later than that are what the buffer's lag guard is for; lag ``<= k`` of every trained sample is
guaranteed by the guard, the controller keeps such drops rare. ``min_version`` is clamped at 0, which is
equivalent to the raw (possibly negative) formula because versions start at 0.

Resuming. A run resumed at version ``V`` has already consumed slots ``0 .. V*B - 1`` (in the run that wrote the
checkpoint). ``start_version=V`` starts the controller as if those slots were granted and consumed: fresh indices
start at ``V*B`` and the live count at ``V*B``, so at most ``(k + 1) * B`` tickets are in flight at once, exactly as
in a run that never stopped. Starting at ``version=V`` without the offset would grant ``(k + V + 1) * B`` at once.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Ticket:
    """Permission to generate one group. ``index`` identifies it; ``min_version`` is the oldest weights allowed."""

    index: int
    min_version: int


class AdmissionController:
    """Thread-safe ticket accounting. Pure logic: no sockets (see :mod:`asyncppo.staleness.server`)."""

    def __init__(self, batch_groups: int, max_staleness: int, version: int = 0, start_version: int = 0):
        if type(batch_groups) is not int or batch_groups < 1:
            raise ValueError(f"batch_groups must be an int >= 1, got {batch_groups!r}")
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if type(start_version) is not int or start_version < 0:
            raise ValueError(f"start_version must be an int >= 0, got {start_version!r}")
        self.B = batch_groups
        self.k = max_staleness
        self.start_version = start_version
        self._v = max(version, start_version)
        self._lock = threading.Lock()
        # slots 0 .. start_version*B - 1 were consumed before a resume: they count as live and are never re-granted
        self._next_index = start_version * batch_groups
        self._free: list[int] = []  # released indices, re-granted smallest first
        self._outstanding: set[int] = set()  # granted, neither consumed nor released
        self._live = start_version * batch_groups  # granted - released: the slots in use, consumed ones included
        self.granted = 0  # grants, including re-grants of released indices
        self.released = 0
        self.release_unknown = 0  # release() of an index that was not outstanding: refused, counted
        self.consumed_count = 0
        self.stopped = False

    # --------------------------------------------------------------------------------------------- state
    @property
    def version(self) -> int:
        return self._v

    def set_version(self, v: int) -> None:
        """The learner finished step ``v - 1``; more tickets become grantable. Versions never go back."""
        with self._lock:
            if v < self._v:
                raise ValueError(f"version must not decrease: {self._v} -> {v}")
            self._v = v

    def stop(self) -> None:
        """No more tickets, ever (the run is ending); clients are told to stop."""
        with self._lock:
            self.stopped = True

    def capacity(self) -> int:
        """How many tickets may be live right now: ``(k + v + 1) * B``."""
        return (self.k + self._v + 1) * self.B

    # --------------------------------------------------------------------------------------------- grants
    def try_acquire(self) -> Ticket | None:
        """A ticket, or None if the pool is exhausted for the current version (or stopped)."""
        with self._lock:
            if self.stopped:
                return None
            live = self._live
            if live >= self.capacity():
                return None
            index = heapq.heappop(self._free) if self._free else self._take_fresh()
            self._outstanding.add(index)
            self._live += 1
            self.granted += 1
            # slot rule, and never older than the index's own rule (attainable: index < (k + v + 1) * B)
            return Ticket(index=index, min_version=max(0, live // self.B - self.k, index // self.B - self.k))

    def _take_fresh(self) -> int:
        i = self._next_index
        self._next_index += 1
        return i

    def release(self, ticket: Ticket | int) -> bool:
        """Return the ticket of a group that was dropped (never trained), so its slot is granted again; True if
        it was returned.

        An index that is not outstanding (never granted, already released, already consumed, or -1) is a counted
        no-op (``release_unknown``) that returns False: a double release must not widen the pool beyond
        ``(k + v + 1) * B``, and since the index can come from a peer (a forged record, a stray release message),
        refusing it must never raise through the learner."""
        index = ticket.index if isinstance(ticket, Ticket) else ticket
        with self._lock:
            if type(index) is not int or index not in self._outstanding:
                self.release_unknown += 1
                return False
            self._outstanding.remove(index)
            self._live -= 1
            heapq.heappush(self._free, index)
            self.released += 1
            return True

    def consumed(self, ticket: Ticket | int) -> None:
        """The group of this ticket was handed to the learner: it keeps its slot for good, can no longer be
        released, and stops counting as in flight. Optional (only bookkeeping and memory depend on it); unknown
        indices (e.g. -1 for groups made without a ticket) are ignored."""
        index = ticket.index if isinstance(ticket, Ticket) else ticket
        with self._lock:
            if index in self._outstanding:
                self._outstanding.remove(index)
                self.consumed_count += 1

    def lowest_outstanding(self, n: int) -> list[int]:
        """The ``n`` smallest outstanding ticket indices, ascending (fewer if fewer are outstanding): the groups
        the learner must train next when it consumes in ticket order (see :class:`StalenessBuffer`)."""
        with self._lock:
            return heapq.nsmallest(n, self._outstanding)

    def is_outstanding(self, index: int) -> bool:
        with self._lock:
            return index in self._outstanding

    def stats(self) -> dict[str, int]:
        """Counts: granted (re-grants included), released, consumed, live (slots in use), in_flight (granted
        but neither consumed nor released; exact only if :meth:`consumed` is called), capacity, version."""
        with self._lock:
            return {
                "granted": self.granted,
                "released": self.released,
                "release_unknown": self.release_unknown,
                "consumed": self.consumed_count,
                "live": self._live,
                "in_flight": len(self._outstanding),
                "capacity": self.capacity(),
                "version": self._v,
            }
