"""Who gets the next admission ticket when several rollout workers wait: max-min fair by tickets held.

Why. The staleness rule (:mod:`asyncppo.staleness.controller`) says how many tickets may be live; it says nothing
about who gets them. Served in arrival order, a worker whose engine has room for many groups (``max_num_seqs=256``
asks for 64 groups at once) parks all its requests first and takes the whole pool, and the second engine idles.

The rule. Each free ticket goes to the waiting connection that *holds* the fewest tickets (granted, group not yet
arrived), among those below the per-connection cap (``cluster.max_tickets_per_worker``); ties go to the connection
served least recently (round-robin), then to the oldest parked request. Repeated for every free ticket, this is
water-filling: a worker that asks for little gets all it asks, workers that each want more than an equal share end
up holding equal shares (within one ticket), and a worker that waits is served before any worker holding more than
it, so none starves. A worker's demand is what it holds plus what it has parked, i.e. its free engine slots:
holdings follow demand up to the equal share. Tickets already granted are never taken back; so that the first engine
up does not take the whole pool before the second one asks, each connection holds at most an equal share of the
in-flight window until every expected worker has asked once (:func:`startup_cap`).
"""

from __future__ import annotations

import threading
import time
from typing import Hashable, Iterable, Mapping, Optional


def next_holder(waiting: Iterable[Hashable], held: Mapping[Hashable, int],
                cap: Optional[int] = None) -> Optional[Hashable]:
    """The connection the next free ticket goes to: among ``waiting`` (connections with a parked request, in
    tie-break order: least recently served first) and below ``cap`` tickets held, the one holding fewest; the
    earliest of equals. None if every waiting connection is at its cap."""
    best, best_held = None, None
    for key in waiting:
        h = held.get(key, 0)
        if cap is not None and h >= cap:
            continue
        if best_held is None or h < best_held:
            best, best_held = key, h
    return best


def allocate(wants: Mapping[Hashable, int], held: Mapping[Hashable, int], free: int,
             cap: Optional[int] = None) -> dict[Hashable, int]:
    """How ``free`` tickets are split by :func:`next_holder` among connections with ``wants[key]`` parked requests
    (in the mapping's order), given what each already holds. The server grants one ticket at a time with the same
    rule; this whole-batch form states it for the tests and the docs."""
    held, left = dict(held), {k: int(n) for k, n in wants.items() if n > 0}
    granted = {k: 0 for k in wants}
    for _ in range(max(0, free)):
        key = next_holder(list(left), held, cap)
        if key is None:
            break
        granted[key] += 1
        held[key] = held.get(key, 0) + 1
        left[key] -= 1
        if not left[key]:
            del left[key]
    return granted


def startup_cap(window: int, expected_workers: Optional[int], asked: int, cap: Optional[int]) -> Optional[int]:
    """The holding cap while not every expected worker has asked yet: each connection may hold at most an equal
    share, ``ceil(window / expected_workers)``, of the ``window = (j + 1) * B`` tickets that can be in flight (``j``
    the admission lookahead, ``k`` unless set), so
    the first engine up does not take the whole pool before the second one asks (tickets are never taken back).
    The reservation ends for good once ``expected_workers`` distinct workers have asked; ``cap`` always holds."""
    if not expected_workers or asked >= expected_workers:
        return cap
    share = max(1, -(-window // expected_workers))
    return share if cap is None else min(cap, share)


def auto_ticket_cap(max_num_seqs: int, group_size: int, prompts_per_call: int, window: int, episodes: bool) -> int:
    """``cluster.max_tickets_per_worker=0``: how many tickets one worker connection may hold.

    Single-turn groups hold their engine slots for their whole life, so a worker rarely needs more groups than its
    engine has room for: ``room = max_num_seqs // group_size`` (or a batch engine's ``prompts_per_call``), and the
    cap ``2 * room + 2`` leaves room for the groups that have finished and are on their way to the learner, and
    for the tickets a worker asks for beyond its room while all it holds wait for a push (rollout/worker.py).

    Multi-turn episodes leave the engine at every environment call, and the worker admits by the load its episodes
    *will* make (``max_num_seqs / share`` episodes, envs/episode_worker.py: ``EngineShare``): behind a 200 ms tool
    an episode spends ~20% of its life in the engine, so a worker keeps ~5x ``room`` groups in flight to keep its
    engine full. A cap sized by engine slots stops it there (measured: 18 groups held, the engine half empty while
    the staleness window had room for 36). So for episodes the cap is the window itself, ``window = (j + 1) * B``;
    with several workers the max-min rule above still splits it evenly among those that want more."""
    if episodes:
        return max(1, window)
    room = max(max_num_seqs // max(group_size, 1), prompts_per_call, 1)
    return 2 * room + 2


class HoldingClock:
    """Per worker, the seconds it held at least one ticket since it first asked: while a worker holds a ticket its
    engine has a group to generate, so this is its engine's busy time as admission sees it, measured on one clock
    for every worker (the fairness test compares workers by it). Thread-safe; :meth:`freeze` ends the window when
    admission stops, so the run's closing evaluation and save do not dilute it."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._first: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._since: dict[int, float] = {}  # when its count last went from 0 to 1
        self._busy: dict[int, float] = {}
        self._end: Optional[float] = None

    def seen(self, worker: int) -> None:
        """``worker`` asked for a ticket: its window starts at its first request."""
        with self._lock:
            if self._end is None:
                self._first.setdefault(worker, self._clock())

    def add(self, worker: int, delta: int) -> None:
        """``worker`` now holds ``delta`` more tickets (negative: fewer)."""
        with self._lock:
            now = self._clock()
            self._first.setdefault(worker, now)
            before = self._count.get(worker, 0)
            after = max(0, before + delta)
            self._count[worker] = after
            if before == 0 and after > 0:
                self._since[worker] = now
            elif before > 0 and after == 0:
                self._close(worker, now)

    def _close(self, worker: int, now: float) -> None:
        start = self._since.pop(worker, None)
        if start is not None and self._end is None:
            self._busy[worker] = self._busy.get(worker, 0.0) + max(0.0, now - start)

    def freeze(self) -> None:
        with self._lock:
            if self._end is None:
                now = self._clock()
                for worker in list(self._since):
                    self._close(worker, now)
                self._end = now

    def busy_fractions(self) -> dict[int, float]:
        """Per worker: seconds holding >= 1 ticket / seconds since its first request (up to :meth:`freeze`)."""
        with self._lock:
            now = self._end if self._end is not None else self._clock()
            out = {}
            for worker, first in sorted(self._first.items()):
                busy = self._busy.get(worker, 0.0)
                if worker in self._since and self._end is None:
                    busy += now - self._since[worker]
                out[worker] = round(busy / max(now - first, 1e-9), 4)
            return out
