"""The learner-side buffer between the trajectory stream and the PPO step: bounded, groups kept whole, and the
lag guard (docs/architecture.md, "Versions and staleness").

Why groups stay whole: group-relative advantages (GRPO, RLOO) need every sample of a prompt, so the unit that is
stored, dropped and handed out is a :class:`~asyncppo.stream.records.TrajectoryGroup`, never a sample.

Why drop at hand-out time: a group's lag ``learner_version - group.version_min`` only grows while it waits, so the
only moment that decides whether it may be trained on is the moment it is handed to the learner. A dropped group
is reported to ``on_drop`` (the learner releases its admission ticket there) and counted.

Why ticket order (``order=`` the admission controller): with continuous generation groups finish out of order,
long ones last. Taking groups in arrival order would let short groups admitted later overtake a long one until
its lag passes ``k`` and it is dropped: training would be biased against exactly the long samples. In ticket order
the batch at version ``v`` is the ``B`` lowest outstanding tickets, which admission granted no earlier than
version ``v - k`` with ``min_version >= v - k`` (see :mod:`asyncppo.staleness.controller`): every token of the batch
then has lag ``<= k`` *and nothing is dropped*; a straggler makes the learner wait for it instead (the engine keeps
generating later tickets meanwhile). The lag guard stays as the backstop for anything that breaks the rule.

Why deferral under a lookahead (``rollout.admission_lookahead = j < k``): admission then grants tickets with
``min_version = v - j``, nominally lag ``<= j``, each with a deadline ``k - j`` versions later. When some of the
``B`` lowest tickets have not arrived but enough later groups have, the batch takes the lowest arrived ones instead
and the missing tickets stay outstanding (they are the lowest next time), as long as the admission controller
says every ticket not yet trained still meets its deadline (:meth:`AdmissionController.can_defer`); a ticket at
its deadline is waited for, as before. So a straggler with slack no longer stalls the learner, and it is still
trained with lag ``<= k``. ``deferred`` counts the groups trained ahead of a missing lower ticket.

Why no per-sample objects: everything the buffer asks of a record (sample count, per-sample lengths and versions,
token count) is answered from its columns (:meth:`TrajectoryGroup.sample_lengths` and friends), so a group that
arrived columnar stays columnar on its way to the batch. An embodied segment answers the same questions.

Why bounded: when the learner falls behind, ``put`` blocks, the feeder stops reading the socket, and ZeroMQ's
high-water marks push back on the workers instead of memory growing without limit.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from asyncppo.staleness.order import TicketOrder, next_batch
from asyncppo.stream.records import TrajectoryGroup


class BufferClosed(RuntimeError):
    """Raised by ``put`` on a closed buffer."""


#: Drops are counted per bucket of the group's longest response, as a fraction of ``response_length``.
LENGTH_BUCKETS = (0.25, 0.5, 0.75, 1.0)


def length_bucket(num_tokens: int, response_length: int) -> str:
    """``"le25"``, ``"le50"``, ``"le75"`` or ``"le100"``: the quarter of ``response_length`` a length falls in."""
    frac = num_tokens / max(1, response_length)
    for edge in LENGTH_BUCKETS:
        if frac <= edge:
            return f"le{int(edge * 100)}"
    return "le100"


class StalenessBuffer:
    def __init__(
        self,
        max_staleness: int,
        capacity_groups: int,
        on_drop: Optional[Callable[[TrajectoryGroup], None]] = None,
        on_take: Optional[Callable[[TrajectoryGroup], None]] = None,
        order: Optional[TicketOrder] = None,
        response_length: int = 0,
    ):
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if type(capacity_groups) is not int or capacity_groups < 1:
            raise ValueError(f"capacity_groups must be an int >= 1, got {capacity_groups!r}")
        self.k = max_staleness
        self.capacity = capacity_groups
        self.on_drop = on_drop
        self.on_take = on_take
        self.order = order
        self.response_length = response_length
        self._q: collections.deque[TrajectoryGroup] = collections.deque()
        self.rejected_ticket = 0  # ordered mode: groups whose ticket is not outstanding, or already buffered
        self.deferred = 0  # ordered mode: groups trained ahead of a missing lower ticket (admission lookahead)
        self.dropped_tokens = 0
        self.dropped_by_length: collections.Counter[str] = collections.Counter()
        self._cv = threading.Condition()
        self._closed = False
        self.dropped_stale = 0
        self.dropped_samples = 0
        self.put_count = 0
        self.taken = 0
        self._last_lags: list[int] = []
        self._last_spread = 0
        self._last_version: Optional[int] = None

    def __len__(self) -> int:
        with self._cv:
            return len(self._q)

    def put(self, group: TrajectoryGroup, timeout_s: Optional[float] = None) -> bool:
        """Append a group; block while full. False if ``timeout_s`` passed (0: don't wait); BufferClosed if closed."""
        if group.num_samples == 0:
            raise ValueError(f"group {group.group_id!r} has no samples")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while len(self._q) >= self.capacity and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            if self._closed:
                raise BufferClosed("put on a closed StalenessBuffer")
            if self.order is not None and (
                not self.order.is_outstanding(group.ticket) or any(g.ticket == group.ticket for g in self._q)
            ):
                # never granted, already trained or a duplicate: it has no place in the ticket order
                self.rejected_ticket += 1
                return True
            self._q.append(group)
            self.put_count += 1
            self._cv.notify_all()
            return True

    def _drop_stale_locked(self, learner_version: int) -> list[TrajectoryGroup]:
        keep: collections.deque[TrajectoryGroup] = collections.deque()
        dropped = []
        for g in self._q:
            (dropped if learner_version - g.version_min > self._bound(g) else keep).append(g)
        if dropped:
            self._q = keep
            self.dropped_stale += len(dropped)
            self.dropped_samples += sum(g.num_samples for g in dropped)
            for g in dropped:
                self.dropped_tokens += g.num_response_tokens
                self.dropped_by_length[length_bucket(max(g.sample_lengths()), self.response_length)] += 1
            self._cv.notify_all()  # room for blocked producers
        return dropped

    def _bound(self, group: TrajectoryGroup) -> int:
        """The lag a group may have: its ticket's own ``k`` (the one in force at its grant, which a moving window
        never rewrites: controller.py), or ``k`` for a group the order does not know."""
        bound = None if self.order is None else getattr(self.order, "bound_of", lambda _t: None)(group.ticket)
        return self.k if bound is None else min(bound, self.k)

    def take(self, n_groups: int, learner_version: int, timeout_s: Optional[float] = None) -> list[TrajectoryGroup]:
        """Hand out the next ``n_groups`` groups whose lag at ``learner_version`` is ``<= k`` (the oldest arrivals,
        or in ordered mode exactly the ``n_groups`` lowest outstanding tickets), dropping every stale one met on
        the way. Waits for the whole batch; on timeout (or close, or once it dropped a stale group, whose ticket must
        be released before anything waits on it) returns ``[]`` and keeps what is buffered, so a caller can retry
        without losing anything."""
        if n_groups < 1 or n_groups > self.capacity:
            raise ValueError(f"n_groups must be in [1, capacity={self.capacity}], got {n_groups}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        dropped: list[TrajectoryGroup] = []
        out: list[TrajectoryGroup] = []
        with self._cv:
            while True:
                dropped += self._drop_stale_locked(learner_version)
                out = self._pop_batch_locked(n_groups, learner_version)
                if out:
                    self.taken += n_groups
                    self._record_lags(out, learner_version)
                    self._cv.notify_all()
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0) or dropped:
                    # dropped: return now so their tickets are released (below, outside the lock) and granted
                    # again; waiting on would wait for a dropped ticket still outstanding until the timeout
                    break
                # ordered mode also waits on grants (other threads): re-check now and then, not only on put
                self._cv.wait(left if self.order is None else min(left if left is not None else 0.05, 0.05))
        # Callbacks run outside the lock: they may talk to sockets or the admission controller.
        for g in dropped:
            if self.on_drop is not None:
                self.on_drop(g)
        for g in out:
            if self.on_take is not None:
                self.on_take(g)
        return out

    def _pop_batch_locked(self, n: int, learner_version: int) -> list[TrajectoryGroup]:
        """The next batch if it is complete, else [] (nothing removed). Ordered mode: the ``n`` lowest outstanding
        tickets, or, if some of them are missing, the ``n`` lowest arrived ones when the order lets the missing
        ones wait (their deadlines still hold)."""
        if self.order is None:
            return [self._q.popleft() for _ in range(n)] if len(self._q) >= n else []
        by_ticket = {g.ticket: g for g in self._q}
        pick = next_batch(self.order, by_ticket, n, learner_version)
        if pick is None:
            return []
        want, deferred = pick
        self.deferred += deferred
        chosen = set(want)
        self._q = collections.deque(g for g in self._q if g.ticket not in chosen)
        return [by_ticket[t] for t in want]

    def missing(self, n: int) -> list[int]:
        """Ordered mode: the tickets of the next batch that have not arrived yet (what the learner waits for)."""
        if self.order is None:
            return []
        with self._cv:
            have = {g.ticket for g in self._q}
            return [t for t in self.order.lowest_outstanding(n) if t not in have]

    def _record_lags(self, groups: list[TrajectoryGroup], v: int) -> None:
        self._last_lags = [v - m for g in groups for m in g.sample_version_mins()]
        self._last_spread = max(b - a for g in groups
                                for a, b in zip(g.sample_version_mins(), g.sample_version_maxs()))
        self._last_version = v

    def stats(self) -> dict[str, float]:
        """size, counters, and the lag (``v - version_min``, per sample) of the last batch handed out."""
        with self._cv:
            lags = self._last_lags
            return {
                "size": len(self._q),
                "capacity": self.capacity,
                "put": self.put_count,
                "taken": self.taken,
                "dropped_stale": self.dropped_stale,
                "dropped_samples": self.dropped_samples,
                "dropped_tokens": self.dropped_tokens,
                "rejected_ticket": self.rejected_ticket,
                "deferred": self.deferred,
                **{f"dropped_{b}": c for b, c in sorted(self.dropped_by_length.items())},
                "lag_min": min(lags) if lags else 0,
                "lag_mean": sum(lags) / len(lags) if lags else 0.0,
                "lag_max": max(lags) if lags else 0,
                "version_spread_max": self._last_spread,
            }

    def close(self) -> None:
        """Wake every waiter; ``take`` returns ``[]``, ``put`` raises :class:`BufferClosed`."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed
