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
* a fresh grant occupies slot ``p = L`` and gets ``min_version = max(0, p // B - k, i // B - k)`` for index
  ``i`` (both terms equal ``i // B - k`` when nothing was released). A released index is handed out again first
  (indices stay unique among live tickets, so a trace stays readable), and its min_version is recomputed from the
  batch it will now be trained in: the learner trains the ``B`` lowest outstanding tickets at each version, so
  behind ``a`` lower outstanding tickets and the ``c`` groups of batch ``v`` already trained that is batch
  ``v + (c + a) // B`` and ``min_version = max(0, v + (c + a) // B - k)``. Re-granting a dropped ticket with its
  old, low min_version would only produce another group that is dropped again; taking it from the slot count
  instead would ask for weights of the version being trained, which with pushes every ``s >= 2`` versions the
  engines may never get before that batch (it waited for itself).

Invariant (checked by the tests): at every moment the number of live tickets is ``<= (k + v + 1) * B``, every
grant's ``min_version >= v - k`` for the learner version ``v`` at grant time (because ``L >= v*B``: all consumed
groups came from live tickets), and a group trained no later than its slot's version has lag ``<= k``. Groups
that arrive later than that are what the buffer's lag guard is for; lag ``<= k`` of every trained sample is
guaranteed by the guard, the controller keeps such drops rare. ``min_version`` is clamped at 0, which is
equivalent to the raw (possibly negative) formula because versions start at 0.

Admission lookahead ``j <= k`` (``rollout.admission_lookahead``). The window above buys throughput only because a
straggler gets ``k`` learner steps to finish; it also makes *every* sample ``k`` versions old once the engine fills
it. With a lookahead ``j`` the formulas above hold with ``k`` replaced by ``j``: grants while ``L < (j + v + 1) * B``,
``min_version = max(0, p // B - j, i // B - j)``, so nominally a group has lag ``<= j``. The hard bound stays ``k``:
a group's *deadline*, the last learner version at which it may be trained, is its unclamped min_version plus
``k`` (``p // B - j + k``), i.e. ``k - j`` versions of slack. The buffer may train later tickets ahead of a missing
one while :meth:`AdmissionController.can_defer` says every ticket not yet trained (outstanding or still to be
granted) still meets its deadline at ``B`` groups per version; a ticket at its deadline is waited for. With
``j = k`` (the default) nothing is deferred: ticket order, exactly as without a lookahead.

The run's last slot. A run of ``S`` learner steps trains slots ``0 .. S*B - 1`` and no other: with ``total_slots =
S*B`` the live count is also capped there (``L < min((j + v + 1) * B, total_slots)``), so the engines never generate
the ``j`` batches past the last step that nothing would train (they finish the last batches' groups instead, with
their slots to themselves). A released ticket still frees its slot, so dropped and skipped groups are generated
again as before. ``None``: no last slot (an open-ended controller, as in the property tests).

Resuming. A run resumed at version ``V`` has already consumed slots ``0 .. V*B - 1`` (in the run that wrote the
checkpoint). ``start_version=V`` starts the controller as if those slots were granted and consumed: fresh indices
start at ``V*B`` and the live count at ``V*B``, so at most ``(j + 1) * B`` tickets are in flight at once, exactly as
in a run that never stopped. Starting at ``version=V`` without the offset would grant ``(k + V + 1) * B`` at once.

A window that moves (:meth:`AdmissionController.set_window`, the in-run tuner of ``rollout.max_staleness=auto``).
Each ticket records the ``k`` in force at its grant (:meth:`bound_of`) and its deadline ``nominal + k`` computed
then; a change of ``k`` or ``j`` applies to later grants only and never rewrites an outstanding ticket. The batch
order is plain ticket order while the window never moved (exactly as before windows could move: a re-granted
ticket's later deadline would otherwise reorder batches under ``j < k``), and earliest deadline first, ties by
index, once it has (:meth:`lowest_outstanding`): a lower ``k`` gives a later ticket an earlier deadline, and index
order would train an early-deadline ticket late. Every grant's deadline
is at least its slot's batch (``slot // B``, since ``j <= k``), so the outstanding tickets always fit one per slot
from the learner's version on, each by its deadline: earliest-deadline-first training meets them all, and
:meth:`can_defer` (an exact check of that same schedule) keeps it so. Hence a token is never trained more than the
``k`` of its own ticket after its weights, and never past ``max(k over the run) <= rollout.max_staleness_cap``.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Ticket:
    """Permission to generate one group. ``index`` identifies it; ``min_version`` is the oldest weights allowed."""

    index: int
    min_version: int


class AdmissionController:
    """Thread-safe ticket accounting. Pure logic: no sockets (see :mod:`asyncppo.staleness.server`)."""

    def __init__(self, batch_groups: int, max_staleness: int, version: int = 0, start_version: int = 0,
                 lookahead: int | None = None, total_slots: int | None = None):
        if type(batch_groups) is not int or batch_groups < 1:
            raise ValueError(f"batch_groups must be an int >= 1, got {batch_groups!r}")
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if type(start_version) is not int or start_version < 0:
            raise ValueError(f"start_version must be an int >= 0, got {start_version!r}")
        if lookahead is None:
            lookahead = max_staleness
        if type(lookahead) is not int or not 0 <= lookahead <= max_staleness:
            raise ValueError(f"lookahead must be an int in [0, max_staleness={max_staleness}], got {lookahead!r}")
        if total_slots is not None and (type(total_slots) is not int or total_slots < start_version * batch_groups):
            raise ValueError(f"total_slots must be an int >= start_version * batch_groups "
                             f"({start_version * batch_groups}), got {total_slots!r}")
        self.total_slots = total_slots  # the run's last slot + 1 (module docstring); None: open-ended
        self.B = batch_groups
        self.k = max_staleness
        self.j = lookahead  # admission window and nominal lag; k stays the hard bound (deadlines)
        self.start_version = start_version
        self._v = max(version, start_version)
        self._lock = threading.Lock()
        # slots 0 .. start_version*B - 1 were consumed before a resume: they count as live and are never re-granted
        self._next_index = start_version * batch_groups
        self._free: list[int] = []  # released indices, re-granted smallest first
        self._outstanding: set[int] = set()  # granted, neither consumed nor released
        self._deadline: dict[int, int] = {}  # outstanding index -> last version it may be trained at
        self._bound: dict[int, int] = {}  # outstanding index -> the k in force at its grant (its lag bound)
        self.window_changes = 0  # set_window calls that changed k or j
        self._live = start_version * batch_groups  # granted - released: the slots in use, consumed ones included
        self.granted = 0  # grants, including re-grants of released indices
        self.released = 0
        self.release_unknown = 0  # release() of an index that was not outstanding: refused, counted
        self.consumed_count = 0
        self.stopped = False
        self._listeners: list[Callable[[], None]] = []  # told after every change that may free a ticket

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (outside the lock, from the changing thread) after every change that may make a ticket
        grantable or end the run: a version bump, a release, stop. The admission server wakes on it instead of
        re-checking on a timer."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        for fn in self._listeners:
            fn()

    # --------------------------------------------------------------------------------------------- state
    @property
    def version(self) -> int:
        return self._v

    def set_version(self, v: int) -> None:
        """The learner finished step ``v - 1``; more tickets become grantable. Versions never go back."""
        with self._lock:
            if v < self._v:
                raise ValueError(f"version must not decrease: {self._v} -> {v}")
            bumped, self._v = v != self._v, v
        if bumped:
            self._changed()

    def stop(self) -> None:
        """No more tickets, ever (the run is ending); clients are told to stop."""
        with self._lock:
            self.stopped = True
        self._changed()

    def set_window(self, max_staleness: int, lookahead: int | None = None) -> None:
        """Move the window to ``k = max_staleness``, ``j = lookahead`` (None: ``k``) for every later grant.

        Outstanding tickets keep the bound and deadline of their grant (module docstring: a moving window), so
        lowering ``k`` strands nothing: it narrows new grants (no grant until the live count is back under
        ``(j + v + 1) * B``) and the tickets already out are trained by their own deadlines."""
        if lookahead is None:
            lookahead = max_staleness
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if type(lookahead) is not int or not 0 <= lookahead <= max_staleness:
            raise ValueError(f"lookahead must be an int in [0, max_staleness={max_staleness}], got {lookahead!r}")
        with self._lock:
            changed = (max_staleness, lookahead) != (self.k, self.j)
            self.k, self.j = max_staleness, lookahead
            self.window_changes += changed
        if changed:
            self._changed()

    def capacity(self) -> int:
        """How many tickets may be live right now: ``(j + v + 1) * B`` (``j = k`` unless a lookahead is set), and
        never past the run's last slot."""
        window = (self.j + self._v + 1) * self.B
        return window if self.total_slots is None else min(window, self.total_slots)

    def window(self) -> int:
        """How many tickets can be in flight at once in steady state: ``(j + 1) * B``."""
        return (self.j + 1) * self.B

    # --------------------------------------------------------------------------------------------- grants
    def try_acquire(self) -> Ticket | None:
        """A ticket, or None if the pool is exhausted for the current version (or stopped)."""
        with self._lock:
            if self.stopped:
                return None
            live = self._live
            if live >= self.capacity():
                return None
            if self._free:
                index = heapq.heappop(self._free)
                nominal = self._regrant_nominal(index)
            else:
                index = self._take_fresh()
                # slot rule, and never older than the index's own rule (attainable: index < (j + v + 1) * B)
                nominal = max(live // self.B, index // self.B) - self.j
            self._outstanding.add(index)
            self._live += 1
            self.granted += 1
            self._deadline[index] = nominal + self.k  # unclamped: with j = k exactly the slot's version
            self._bound[index] = self.k
            return Ticket(index=index, min_version=max(0, nominal))

    def _regrant_nominal(self, index: int) -> int:
        """The unclamped min_version of a released ``index`` granted again (under the lock): that of the batch it
        will be trained in. The learner trains the ``B`` lowest outstanding tickets at each version, so behind
        ``a`` outstanding lower tickets and the ``c`` groups of batch ``v`` already trained it is in batch
        ``v + (c + a) // B``; it needs weights ``j`` versions before that, which ``j >= sync_every - 1`` makes
        pushed by then. (The slot rule of fresh grants would put a low index ``j`` batches ahead of where it is
        trained: at a version the learner had not pushed, the batch needing it waited for weights that only that
        batch's own update would bring.)"""
        ahead = sum(1 for other in self._outstanding if other < index)
        # batch v's groups already trained (a dynamic-sampling batch is taken in parts; and between the learner's
        # step and its set_version, the whole batch) come before it too
        done = max(0, self.consumed_count - (self._v - self.start_version) * self.B)
        return self._v + (done + ahead) // self.B - self.j

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
            del self._deadline[index], self._bound[index]
            self._live -= 1
            heapq.heappush(self._free, index)
            self.released += 1
        self._changed()
        return True

    def consumed(self, ticket: Ticket | int) -> None:
        """The group of this ticket was handed to the learner: it keeps its slot for good, can no longer be
        released, and stops counting as in flight. Optional (only bookkeeping and memory depend on it); unknown
        indices (e.g. -1 for groups made without a ticket) are ignored."""
        index = ticket.index if isinstance(ticket, Ticket) else ticket
        with self._lock:
            if index in self._outstanding:
                self._outstanding.remove(index)
                del self._deadline[index], self._bound[index]
                self.consumed_count += 1

    def lowest_outstanding(self, n: int) -> list[int]:
        """The ``n`` outstanding tickets the learner must train next (fewer if fewer are outstanding): earliest
        deadline first, ties by index, which is ascending index while the window never moved (module docstring);
        see :class:`StalenessBuffer`."""
        with self._lock:
            return heapq.nsmallest(n, self._outstanding, key=self._priority_locked)

    def priority(self, index: int) -> tuple[int, int]:
        """The key the batch order sorts tickets by: ``(deadline, index)`` (an unknown index sorts last)."""
        with self._lock:
            return self._priority_locked(index)

    def _priority_locked(self, index: int) -> tuple[int, int]:
        if not self.window_changes:
            # A window that never moved: plain ticket order, exactly the order before windows could move. Earliest
            # deadline first is NOT the same there once a ticket is granted again under a lookahead j < k (its
            # deadline, a later batch's nominal + k, can pass a fresh higher ticket's: a review's simulation gave
            # other batches in 273 of 3,000 random runs), and the re-grant's min_version and the worker's
            # take_startable both assume index order.
            return 0, index
        return self._deadline.get(index, 1 << 62), index

    def bound_of(self, index: int) -> int | None:
        """The ``k`` in force when outstanding ticket ``index`` was granted: the most versions its tokens may lag
        when trained (the buffer's guard checks this, not the current ``k``); None if it is not outstanding."""
        with self._lock:
            return self._bound.get(index)

    def is_outstanding(self, index: int) -> bool:
        with self._lock:
            return index in self._outstanding

    def deadline_of(self, index: int) -> int | None:
        """The last learner version at which outstanding ticket ``index`` may be trained within the bound ``k``
        (its unclamped min_version plus ``k``); None if it is not outstanding."""
        with self._lock:
            return self._deadline.get(index)

    def can_defer(self, take: Iterable[int], version: int) -> bool:
        """May the learner train the tickets ``take`` at ``version`` although lower tickets are still missing?

        True only under a lookahead ``j < k`` and only if, after ``take``, every ticket not yet trained still meets
        its deadline when the learner trains ``B`` groups per version from ``version + 1`` on, earliest deadline
        first: the outstanding ones by their stored deadline, those still to be granted by the lower bound of the
        slots they will occupy (``L, L + 1, ...``: a grant never gets an earlier deadline than its slot's). In
        sorted order the ``m``-th deadline (1-based) must be ``>= version + ceil(m / B)``. A missing ticket whose
        deadline is ``version`` fails this at once, so it is waited for. The future grants' deadlines grow by one
        per ``B`` slots, as fast as the batches do, so checking ``B`` of them past the last outstanding deadline
        decides the infinite rest."""
        taking = set(take)
        with self._lock:
            if self.j >= self.k:
                return False
            rest = sorted(d for i, d in self._deadline.items() if i not in taking)
            B, live = self.B, self._live
            last = rest[-1] if rest else version
            n_future = max(0, (last + 1 + self.j - self.k) * B - live) + B
            future = ((live + m) // B - self.j + self.k for m in range(n_future))
            for m, deadline in enumerate(heapq.merge(rest, future), start=1):
                if deadline < version + -(-m // B):
                    return False
            return True

    def stats(self) -> dict[str, int]:
        """Counts: granted (re-grants included), released, consumed, live (slots in use), in_flight (granted
        but neither consumed nor released; exact only if :meth:`consumed` is called), capacity, version, and the
        lookahead ``j``."""
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
                "lookahead": self.j,
            }
