"""Hung rollout workers: found by the launcher, then killed through Ray and replaced like dead ones.

A process that died is seen by Ray at once; a process that is stopped (SIGSTOP) or wedged (an engine call that never
returns) looks alive to Ray forever. So the launcher watches progress itself, from two sides:

* **the worker**: a control ping (``RolloutActor.heartbeat``, or ``EnvRolloutActor.heartbeat`` in an embodied run:
  a Ray call answered by another thread of the actor) returns the phase the worker's loop is in and a counter of its
  progress (decode steps or env steps, groups or segments sent, weight loads). A stopped process answers nothing; a
  wedged one (an engine call, or an environment's ``step``, that never returns) answers, but its counter stops while
  it should be generating.
* **the learner**: a worker that did not take a weight push within ``cluster.push_timeout_s`` was retired from the
  weight sync (``WeightFanout.retire_late``); the learner reports it (``LearnerActor.health``), with its recent step
  durations, from which the auto deadlines are computed (config/deadlines.py).

:func:`hang_verdict` is the decision, a pure function of what was seen and when: a worker is hung when

1. it missed a push deadline; or
2. it has answered no ping since it started for longer than the start-up grace (``cluster.timeout_s``: an engine
   start-up on a loaded machine may take minutes, and the actor answers nothing while Ray constructs it); or
3. its last answer is older than the hang timeout (the start-up grace while it reported *starting*); or
4. it is *generating* and its progress counter has not moved for the hang timeout; or it is *starting* or
   *loading* weights and has not moved for the start-up grace.

A worker that is *waiting* (for a ticket because the staleness bound holds admission, for weights, for the learner
to take a group) and answers its pings is never hung: the wait is the learner's, not the worker's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray

from asyncppo.config.deadlines import hang_timeout

log = logging.getLogger("asyncppo.launch")

# Seconds between two control pings to a worker (and between two health reads from the learner).
PING_EVERY_S = 2.0
# Phases that must show progress within the hang timeout, and phases allowed the start-up grace.
BUSY_PHASES = ("generating",)
SLOW_PHASES = ("starting", "loading")


@dataclass
class Seen:
    """What the launcher saw of one incarnation of one worker (times from ``time.monotonic``)."""

    started_at: float
    answered_at: Optional[float] = None  # the newest answer to a ping
    phase: str = "starting"  # the phase in that answer
    progress: int = -1  # the progress counter in that answer
    moved_at: Optional[float] = None  # when the counter or the phase last changed

    def answer(self, now: float, phase: str, progress: int) -> None:
        if self.answered_at is None or progress != self.progress or phase != self.phase:
            self.moved_at = now
        self.answered_at, self.phase, self.progress = now, phase, progress


def hang_verdict(seen: Seen, now: float, hang_s: float, grace_s: float, push_late: Optional[str] = None
                 ) -> Optional[str]:
    """Why the worker is hung (module docstring, rules 1-4), or None. ``hang_s``: the hang timeout; ``grace_s``:
    the start-up grace; ``push_late``: the learner's report that it missed a push deadline."""
    if push_late:
        return push_late
    if seen.answered_at is None:
        silent = now - seen.started_at
        return (f"no answer to a control ping for {silent:.0f}s since it started (start-up grace {grace_s:.0f}s, "
                "cluster.timeout_s)") if silent > grace_s else None
    silent = now - seen.answered_at
    # while the engine starts, long imports and model loads may hold the interpreter: the grace, not the timeout
    limit, name = (grace_s, "start-up grace") if seen.phase == "starting" else (hang_s, "hang timeout")
    if silent > limit:
        return f"no answer to a control ping for {silent:.0f}s ({name} {limit:.0f}s)"
    still = now - (seen.moved_at if seen.moved_at is not None else seen.answered_at)
    if seen.phase in BUSY_PHASES and still > hang_s:
        return f"no progress (decode or env step, group sent) for {still:.0f}s while {seen.phase} (hang timeout " \
               f"{hang_s:.0f}s)"
    if seen.phase in SLOW_PHASES and still > grace_s:
        return f"still {seen.phase} after {still:.0f}s (grace {grace_s:.0f}s, cluster.timeout_s)"
    return None


class HangWatch:
    """Pings every rollout worker and reads the learner's health, without ever blocking the supervisor: at most one
    call to each actor is outstanding, and an unanswered one simply leaves the worker's silence growing."""

    def __init__(self, workers: Callable[[], dict[int, Any]], incarnations: dict[int, int], learner: Any,
                 hang_timeout_s: Optional[float], timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.workers, self.incarnations, self.learner = workers, incarnations, learner
        self.configured, self.timeout_s, self.clock = hang_timeout_s, timeout_s, clock
        self.seen: dict[int, Seen] = {}
        self._pings: dict[int, tuple[Any, Any]] = {}  # worker id -> (actor pinged, its outstanding ref)
        self._last_ping: dict[int, float] = {}
        self._health_ref: Any = None
        self._health_at = 0.0
        self.step_seconds: list[float] = []
        self.push_late: dict[tuple[int, int], str] = {}  # (worker id, incarnation) -> why

    def hang_s(self) -> float:
        return hang_timeout(self.configured, self.step_seconds, self.timeout_s)

    def started(self, worker_id: int) -> None:
        """A (new incarnation of a) worker was started: its clock starts now."""
        self.seen[worker_id] = Seen(started_at=self.clock())
        self._pings.pop(worker_id, None)

    def poll(self) -> list[tuple[int, str]]:
        """Collect answers, send the next pings; the workers found hung, each with why and for how long."""
        now = self.clock()
        self._read_learner(now)
        hung, hang_s = [], self.hang_s()
        for i, actor in list(self.workers().items()):
            seen = self.seen.setdefault(i, Seen(started_at=now))
            self._ping(i, actor, seen, now)
            why = hang_verdict(seen, now, hang_s, self.timeout_s,
                               self.push_late.get((i, self.incarnations.get(i, 0))))
            if why is not None:
                hung.append((i, why))
        return hung

    def _ping(self, i: int, actor: Any, seen: Seen, now: float) -> None:
        pinged, ref = self._pings.get(i, (None, None))
        if ref is not None and pinged is actor:
            if not ray.wait([ref], timeout=0)[0]:
                return  # still unanswered: a stopped process never answers
            self._pings[i] = (actor, None)  # consumed: the same answer is never read twice
            try:
                beat = ray.get(ref)
                seen.answer(now, str(beat.get("phase", "")), int(beat.get("progress", -1)))
            except ray.exceptions.RayError:
                pass  # the actor died: the supervisor sees its run() fail and replaces it
        if now - self._last_ping.get(i, -PING_EVERY_S) >= PING_EVERY_S or pinged is not actor:
            self._pings[i] = (actor, actor.heartbeat.remote())
            self._last_ping[i] = now

    def _read_learner(self, now: float) -> None:
        if self._health_ref is not None:
            if not ray.wait([self._health_ref], timeout=0)[0]:
                return
            try:
                health = ray.get(self._health_ref)
                self.step_seconds = [float(s) for s in health.get("step_seconds", [])]
                for worker_id, incarnation, why in health.get("push_late", []):
                    self.push_late[(int(worker_id), int(incarnation))] = why
            except ray.exceptions.RayError:
                pass  # the learner's own failure ends the run through its run() ref
            self._health_ref = None
        if now - self._health_at >= PING_EVERY_S:
            self._health_ref, self._health_at = self.learner.health.remote(), now
