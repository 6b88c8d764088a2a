"""Hung rollout workers: found by the launcher, then killed through Ray and replaced like dead ones.

A process that died is seen by Ray at once; a process that is stopped (SIGSTOP) or wedged (an engine call that never
returns) looks alive to Ray forever. So the launcher watches progress itself, from two sides:

* **the worker**: a control ping (``RolloutActor.heartbeat``, or ``EnvRolloutActor.heartbeat`` in an embodied run:
  a Ray call answered by another thread of the actor) returns the phase the worker's loop is in and a counter of its
  progress (decode steps or env steps, groups or segments sent, weight loads), and for a worker with text
  environments how its environment calls fare. A stopped process answers nothing (``ray.wait`` never sees the ref
  ready; measured: a peer answered every ping meanwhile); a wedged one (an engine call, or an environment's ``step``,
  that never returns) answers, but its counter stops while it should be generating.
* **the learner**: a worker that did not take a weight push within ``cluster.push_timeout_s`` was retired from the
  weight sync (``WeightFanout.retire_late``); the learner reports it (``LearnerActor.health``), with its recent step
  durations, from which the auto deadlines are computed (config/deadlines.py). Its answers also show that the
  machine is answering calls at all.

:func:`judge` (and :func:`hang_verdict`, its reason alone) is the decision, a pure function of what was seen and
when: a worker is hung when

1. it missed a push deadline; or
2. it has answered no ping since it started for longer than the start-up grace (``cluster.timeout_s``: an engine
   start-up on a loaded machine may take minutes, and the actor answers nothing while Ray constructs it); or
3. **silent**: it answered before, is past its start-up, and has answered nothing for the silent deadline
   (``cluster.silent_timeout_s``, 15 s) while the learner and every other worker past its start-up kept answering,
   each at most :func:`steady_gap` seconds apart, over that whole time. A busy process still answers (another thread
   of the actor answers, late at worst); one that answers nothing at all while its peers answer in time is stopped,
   or wedged in a call that holds its interpreter. When everybody is late together (a loaded or
   swapping machine, a stalled Ray) nobody is blamed by this rule: rule 4 waits the hang timeout; or
4. its last answer is older than the hang timeout (the start-up grace while it reported *starting*); or
5. it is *generating* and its progress counter has not moved for the hang timeout; or it is *starting* or
   *loading* weights and has not moved for the start-up grace; or
6. its text environments hang: a call is still running past its deadline (``env.step_timeout_s``) and calls have
   waited the hang timeout with none returned (idle time, with no call asked, does not count). The worker keeps
   answering and counts its idle waits for those calls as steps, so rules 3-5 never see it; a replacement process
   starts with fresh threads and a fresh event loop.

A worker that is *waiting* (for a ticket because the staleness bound holds admission, for weights, for the learner
to take a group) and answers its pings is never hung: the wait is the learner's, not the worker's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import ray

from asyncppo.config.deadlines import hang_timeout, silent_timeout

log = logging.getLogger("asyncppo.launch")

# Seconds between two control pings to a worker (and between two health reads from the learner).
PING_EVERY_S = 2.0
# Phases that must show progress within the hang timeout, and phases allowed the start-up grace.
BUSY_PHASES = ("generating",)
SLOW_PHASES = ("starting", "loading")


def steady_gap(silent_s: float) -> float:
    """The longest time between two answers of a peer that still counts as answering in time: three ping periods,
    or half the silent deadline when that is longer (a peer must answer at least twice while a worker is silent)."""
    return max(3 * PING_EVERY_S, silent_s / 2)


@dataclass
class Seen:
    """What the launcher saw of one incarnation of one worker, or of the learner (times from ``time.monotonic``)."""

    started_at: float
    answered_at: Optional[float] = None  # the newest answer to a ping
    phase: str = "starting"  # the phase in that answer
    progress: int = -1  # the progress counter in that answer
    moved_at: Optional[float] = None  # when the counter or the phase last changed
    steady_since: Optional[float] = None  # since when its answers came at most `gap_s` apart (the silent rule)
    longest_gap: float = 0.0  # the longest time between two answers past its start-up (how close to rule 3)
    env_stuck: int = 0  # its text-environment calls still running past their deadline (rule 6)
    env_unanswered_s: float = 0.0  # seconds its calls have waited since an environment last returned

    def answer(self, now: float, phase: str, progress: int, gap_s: float = float("inf"),
               env: Optional[dict] = None) -> None:
        if self.answered_at is None or progress != self.progress or phase != self.phase:
            self.moved_at = now
        if self.answered_at is None or now - self.answered_at > gap_s:
            self.steady_since = now
        if self.answered_at is not None and self.phase != "starting":
            self.longest_gap = max(self.longest_gap, now - self.answered_at)
        self.answered_at, self.phase, self.progress = now, phase, progress
        if env:
            self.env_stuck, self.env_unanswered_s = int(env.get("stuck", 0)), float(env.get("unanswered_s", 0.0))


class Verdict(NamedTuple):
    """One worker found hung: which rule (module docstring: push, start-up, silent, silence, progress, environment)
    and why, in words that name the option to change."""

    rule: str
    why: str


def _steady(ref: Seen, now: float, window_s: float, gap_s: float) -> bool:
    """``ref`` answered within the last ``gap_s`` and at most ``gap_s`` apart over the last ``window_s``."""
    return (ref.answered_at is not None and now - ref.answered_at <= gap_s and ref.steady_since is not None
            and ref.steady_since <= now - window_s)


def judge(seen: Seen, now: float, hang_s: float, grace_s: float, push_late: Optional[str] = None,
          silent_s: Optional[float] = None, learner: Optional[Seen] = None, peers: Sequence[Seen] = ()
          ) -> Optional[Verdict]:
    """Which rule (module docstring, 1-6) finds the worker hung, and why; or None. ``hang_s``: the hang timeout;
    ``grace_s``: the start-up grace; ``push_late``: the learner's report that it missed a push deadline;
    ``silent_s``: the silent deadline (None: no silent rule); ``learner`` and ``peers``: what was seen of the learner
    and of the other workers, the references of the silent rule."""
    if push_late:
        return Verdict("push", push_late)
    if seen.answered_at is None:
        silent = now - seen.started_at
        return Verdict("start-up", f"no answer to a control ping for {silent:.0f}s since it started (start-up grace "
                                   f"{grace_s:.0f}s, cluster.timeout_s)") if silent > grace_s else None
    silent = now - seen.answered_at
    if silent_s is not None and seen.phase != "starting" and silent > silent_s and learner is not None:
        gap = steady_gap(silent_s)
        others = [p for p in peers if p.answered_at is not None and p.phase != "starting"]
        if _steady(learner, now, silent_s, gap) and all(_steady(p, now, silent_s, gap) for p in others):
            who = "the learner" + (f" and {len(others)} other worker(s)" if others else "")
            return Verdict("silent", f"no answer to a control ping for {silent:.0f}s while {who} answered every "
                                     f"{gap:.0f}s or sooner (silent deadline {silent_s:.0f}s, "
                                     "cluster.silent_timeout_s)")
    # while the engine starts, long imports and model loads may hold the interpreter: the grace, not the timeout
    limit, name = (grace_s, "start-up grace") if seen.phase == "starting" else (hang_s, "hang timeout")
    if silent > limit:
        return Verdict("silence", f"no answer to a control ping for {silent:.0f}s ({name} {limit:.0f}s)")
    still = now - (seen.moved_at if seen.moved_at is not None else seen.answered_at)
    if seen.phase in BUSY_PHASES and still > hang_s:
        return Verdict("progress", f"no progress (decode or env step, group sent) for {still:.0f}s while "
                                   f"{seen.phase} (hang timeout {hang_s:.0f}s)")
    if seen.env_stuck and seen.env_unanswered_s > hang_s:
        return Verdict("environment", f"its text environments hang: {seen.env_stuck} call(s) still running past "
                                      f"env.step_timeout_s, and calls waited {seen.env_unanswered_s:.0f}s with none "
                                      f"returned (hang timeout {hang_s:.0f}s)")
    if seen.phase in SLOW_PHASES and still > grace_s:
        return Verdict("start-up" if seen.phase == "starting" else "loading",
                       f"still {seen.phase} after {still:.0f}s (grace {grace_s:.0f}s, cluster.timeout_s)")
    return None


def hang_verdict(seen: Seen, now: float, hang_s: float, grace_s: float, push_late: Optional[str] = None,
                 silent_s: Optional[float] = None, learner: Optional[Seen] = None, peers: Sequence[Seen] = ()
                 ) -> Optional[str]:
    """Why the worker is hung (:func:`judge`'s reason), or None."""
    verdict = judge(seen, now, hang_s, grace_s, push_late, silent_s, learner, peers)
    return None if verdict is None else verdict.why


class HangWatch:
    """Pings every rollout worker and reads the learner's health, without ever blocking the supervisor: at most one
    call to each actor is outstanding, and an unanswered one simply leaves the worker's silence growing. Every answer
    of a round is collected before any verdict, so a worker is never judged against peers read later than itself."""

    def __init__(self, workers: Callable[[], dict[int, Any]], incarnations: dict[int, int], learner: Any,
                 hang_timeout_s: Optional[float], timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 silent_timeout_s: Optional[float] = None):
        self.workers, self.incarnations, self.learner = workers, incarnations, learner
        self.configured, self.timeout_s, self.clock = hang_timeout_s, timeout_s, clock
        self.silent_configured = silent_timeout_s
        self.seen: dict[int, Seen] = {}
        self.learner_seen = Seen(started_at=clock())
        self._pings: dict[int, tuple[Any, Any]] = {}  # worker id -> (actor pinged, its outstanding ref)
        self._last_ping: dict[int, float] = {}
        self._health_ref: Any = None
        self._health_at = 0.0
        self.step_seconds: list[float] = []
        self.push_late: dict[tuple[int, int], str] = {}  # (worker id, incarnation) -> why

    def hang_s(self) -> float:
        return hang_timeout(self.configured, self.step_seconds, self.timeout_s)

    def silent_s(self) -> Optional[float]:
        return silent_timeout(self.silent_configured, self.hang_s())

    def started(self, worker_id: int) -> None:
        """A (new incarnation of a) worker was started: its clock starts now."""
        self.seen[worker_id] = Seen(started_at=self.clock())
        self._pings.pop(worker_id, None)

    def new_learner(self, learner: Any) -> None:
        """A restarted learner: read it from now on; its answers count from its first."""
        self.learner, self._health_ref = learner, None
        self.learner_seen = Seen(started_at=self.clock())

    def poll(self) -> list[tuple[int, Verdict]]:
        """Collect answers, send the next pings; the workers found hung, each with its verdict."""
        now = self.clock()
        hang_s, silent_s = self.hang_s(), self.silent_s()
        gap = steady_gap(silent_s) if silent_s is not None else float("inf")
        self._read_learner(now, gap)
        actors = dict(self.workers())
        for i, actor in actors.items():
            self._ping(i, actor, self.seen.setdefault(i, Seen(started_at=now)), now, gap)
        hung = []
        for i in actors:
            peers = [self.seen[j] for j in actors if j != i]
            verdict = judge(self.seen[i], now, hang_s, self.timeout_s,
                            self.push_late.get((i, self.incarnations.get(i, 0))), silent_s, self.learner_seen, peers)
            if verdict is not None:
                hung.append((i, verdict))
        return hung

    def _ping(self, i: int, actor: Any, seen: Seen, now: float, gap: float) -> None:
        pinged, ref = self._pings.get(i, (None, None))
        if ref is not None and pinged is actor:
            if not ray.wait([ref], timeout=0)[0]:
                return  # still unanswered: a stopped process never answers
            self._pings[i] = (actor, None)  # consumed: the same answer is never read twice
            try:
                beat = ray.get(ref)
                seen.answer(now, str(beat.get("phase", "")), int(beat.get("progress", -1)), gap, beat.get("env"))
            except ray.exceptions.RayError:
                pass  # the actor died: the supervisor sees its run() fail and replaces it
        if now - self._last_ping.get(i, -PING_EVERY_S) >= PING_EVERY_S or pinged is not actor:
            self._pings[i] = (actor, actor.heartbeat.remote())
            self._last_ping[i] = now

    def _read_learner(self, now: float, gap: float) -> None:
        if self._health_ref is not None:
            if not ray.wait([self._health_ref], timeout=0)[0]:
                return
            try:
                health = ray.get(self._health_ref)
                self.step_seconds = [float(s) for s in health.get("step_seconds", [])]
                for worker_id, incarnation, why in health.get("push_late", []):
                    self.push_late[(int(worker_id), int(incarnation))] = why
                self.learner_seen.answer(now, "learner", 0, gap)
            except ray.exceptions.RayError:
                pass  # the learner's own failure ends the run through its run() ref
            self._health_ref = None
        if now - self._health_at >= PING_EVERY_S:
            self._health_ref, self._health_at = self.learner.health.remote(), now

    def longest_gaps(self) -> dict[int, float]:
        """Per worker, the longest time seen between two of its answers past its start-up (current incarnations):
        how near a live worker came to the silent deadline."""
        return {i: round(s.longest_gap, 2) for i, s in sorted(self.seen.items())}
