"""The learner-side buffer between the trajectory stream and the PPO step: bounded, groups kept whole, and the
lag guard (docs/architecture.md, "Versions and staleness").

Why groups stay whole: group-relative advantages (GRPO, RLOO) need every sample of a prompt, so the unit that is
stored, dropped and handed out is a :class:`~asyncppo.stream.records.TrajectoryGroup`, never a sample.

Why drop at hand-out time: a group's lag ``learner_version - group.version_min`` only grows while it waits, so the
only moment that decides whether it may be trained on is the moment it is handed to the learner. A dropped group
is reported to ``on_drop`` (the learner releases its admission ticket there) and counted.

Why bounded: when the learner falls behind, ``put`` blocks, the feeder stops reading the socket, and ZeroMQ's
high-water marks push back on the workers instead of memory growing without limit.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from asyncppo.stream.records import TrajectoryGroup


class BufferClosed(RuntimeError):
    """Raised by ``put`` on a closed buffer."""


class StalenessBuffer:
    def __init__(
        self,
        max_staleness: int,
        capacity_groups: int,
        on_drop: Optional[Callable[[TrajectoryGroup], None]] = None,
        on_take: Optional[Callable[[TrajectoryGroup], None]] = None,
    ):
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if type(capacity_groups) is not int or capacity_groups < 1:
            raise ValueError(f"capacity_groups must be an int >= 1, got {capacity_groups!r}")
        self.k = max_staleness
        self.capacity = capacity_groups
        self.on_drop = on_drop
        self.on_take = on_take
        self._q: collections.deque[TrajectoryGroup] = collections.deque()
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
        if not group.samples:
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
            self._q.append(group)
            self.put_count += 1
            self._cv.notify_all()
            return True

    def _drop_stale_locked(self, learner_version: int) -> list[TrajectoryGroup]:
        keep: collections.deque[TrajectoryGroup] = collections.deque()
        dropped = []
        for g in self._q:
            (dropped if learner_version - g.version_min > self.k else keep).append(g)
        if dropped:
            self._q = keep
            self.dropped_stale += len(dropped)
            self.dropped_samples += sum(len(g.samples) for g in dropped)
            self._cv.notify_all()  # room for blocked producers
        return dropped

    def take(self, n_groups: int, learner_version: int, timeout_s: Optional[float] = None) -> list[TrajectoryGroup]:
        """Hand out the ``n_groups`` oldest groups whose lag at ``learner_version`` is ``<= k``, dropping every
        stale one met on the way. Waits for enough groups; on timeout (or close) returns ``[]`` and keeps what
        is buffered, so a caller can retry without losing anything."""
        if n_groups < 1 or n_groups > self.capacity:
            raise ValueError(f"n_groups must be in [1, capacity={self.capacity}], got {n_groups}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        dropped: list[TrajectoryGroup] = []
        out: list[TrajectoryGroup] = []
        with self._cv:
            while True:
                dropped += self._drop_stale_locked(learner_version)
                if len(self._q) >= n_groups:
                    out = [self._q.popleft() for _ in range(n_groups)]
                    self.taken += n_groups
                    self._record_lags(out, learner_version)
                    self._cv.notify_all()
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    break
                self._cv.wait(left)
        # Callbacks run outside the lock: they may talk to sockets or the admission controller.
        for g in dropped:
            if self.on_drop is not None:
                self.on_drop(g)
        for g in out:
            if self.on_take is not None:
                self.on_take(g)
        return out

    def _record_lags(self, groups: list[TrajectoryGroup], v: int) -> None:
        self._last_lags = [v - s.version_min for g in groups for s in g.samples]
        self._last_spread = max(s.version_max - s.version_min for g in groups for s in g.samples)
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
