"""The window tuner's decisions, made in a process of their own (``rollout.max_staleness=auto``).

Why not on the learner's thread: a decision simulates the current window and each neighbour over several seeds
(:mod:`asyncppo.pipeline.tuner`), ~0.1 s of pure Python per window on data=long's batch (2-core box), ~0.5-1 s a
decision. Made between two steps it stalled the learner, and that stall fell outside the step's own time
(``time/step_s``), while the engine went on filling the buffer: on data=reverse (0.06 s steps, a decision every 5)
an auto run's learner-thread time was ~45% above what its steps recorded, and the window benchmark, which adds the
steps, did not see it (docs/staleness.md, "What a decision costs"). Here the learner hands the tuner's state over a
pipe and goes on; the reply is put in force at the first step after it arrives.

Why a fresh interpreter (``python -m asyncppo.pipeline.tuner_host``) and JSON lines: the learner may be a Ray actor
(multiprocessing's spawn would re-run its main module), and nothing on a pipe is unpickled. The child inherits the
learner's CPU pinning, so on a shared core its work shows up as slower learner steps, where it is counted.

How much it may cost: the child is kept busy at most :data:`SHARE` of the wall time. After a decision that took
``c`` seconds of CPU the next is not sent before ``c * (1 / SHARE - 1)`` seconds; a decision that falls due earlier is
skipped (the next due step tries again), so a run with very short steps decides less often rather than paying more.
Except while the window climbs: after a decision that widened it on a predicted gain of at least
:data:`CLIMB_GAIN`, and that the hook put in force, the share is :data:`CLIMB_SHARE`. A run far below its best window loses that gain at every
step the next move waits; a decision costs a fraction of a second. Measured on the guess game behind a 200 ms tool
(60 steps of ~0.4 s, started at ``k = 1``, best fixed window 16): at a tenth, decisions of 0.6-0.9 s came every
20-27 steps, each moving one step on a predicted +60-90%, and the run ended at ``k = 4``. A climb up several rungs
that ended (``settled`` in the reply: the next rung stopped paying, or the cap) is not climbing any more: after it
the plain share (on the guess game the decision after a ``1 -> 12`` climb, at the half share, came ~20 steps later,
stayed, and its 4-6 s of wall time slowed the learner's updates by a third while it ran).
And while it holds: a decision that finds no move worth making, nor one it waits to make (``pending`` in the reply),
halves the share for the next cool-down, down to :data:`SHARE` / 2 ** :data:`STAY_HALVINGS`; a move put in force
(by a decision or by the drift budget) restores it. Measured on the default task, where every window is within a few
percent and auto stays at ``k = 1``: 5-6 decisions of 1.4-1.8 s in a ~95 s run cost 7.5-9 s of the learner's core,
most of auto's 8% over the best fixed window. Halving after each "stay" makes the cool-downs 19, 39, 79, 79, ...
decision-lengths (9 at the tenth): 3-4 decisions in such a run, and a long run still looks every couple of minutes.
Why niced (:data:`NICE`, 10): the child shares the learner's cores, and on a box with none to spare (2 cores: the
engine, the learner, the environments) every second it computes at the same priority is a second some part of the
run waits. Niceness adds to the parent's, and Ray starts every worker process, the learner's and the engines'
actors included, at nice 15 (Ray's ``worker_niceness``; ``ps -o ni`` during a launch shows it): under a launch the
child sits at nice 19, the most there is, a weight of 15 against the actors' 36, so it gets about 30% of a core they
also want, and all of one they leave idle (outside Ray, nice 10 against 0: 110 against 1024, about a tenth). A run
whose engine waits on a slow tool, the climb's usual case, decides as fast as at the learner's priority, and the
decision's wall time grows on a busy box (the cool-down after it with it). It does not make a decision free:
measured on the guess game, the learner's updates took ~0.1 s (about a third) longer a step while a niced decision
ran beside them, the 30% above; fewer decisions (the back-off, ``settled``) cut that, but not enough.
Why the idle class: with the opening move (opening.py) the first climb no longer waits on a decision, and the
decision after it cost more than any other. Measured on the guess game (seed 0, 60 steps): opened ``1 -> 6`` at
step 3, the first model decision was submitted at step 5 and took 11.6 s of wall time at nice 19, in force at step
39; while it ran the learner's updates took 3.1-3.3 s per 10 steps against 2.1-2.3 s at a fixed ``k = 16``, which
was auto's whole loss past the start (16.3 s of updates against 12.0-13.1 s for every fixed window; 1.21x the best
fixed window's learner time). So once the window has been judged (the hook's first decision made, or a move in
force: the opening's included), the child enters ``SCHED_IDLE`` (a weight of 3, against the actors' 36), for good:
it runs on the time the run leaves a core idle (the learner's waits, the engine's gaps) and takes ~8% of a core the
run wants, not 30%. On a box whose cores are both busy a decision then takes longer (its cool-down, which counts
wall time, with it), which costs a run whose window has been judged little. The first judgement stays at nice 19:
on such a box (two launches at once, measured) an idle-class decision did not finish within a 40-step run, and a
run that starts far from its best window without the learner waiting (so without an opening) needs that one.
Where the platform has no such class (not Linux) or refuses, the child keeps its nice value. Each reply also
carries ``decide_cpu_s``, its CPU time, beside ``decide_s``, its wall time.
Why the cool-down counts CPU time, not wall time: busy is what the share rations, and a niced or idle-class child
spends most of a decision's wall time waiting for a core the run was using, which costs the run nothing. Counted in
wall time, the cool-downs grew with the box's load rather than with the decisions' cost: on ``data=reverse`` an
idle-class decision of 0.3-0.4 s of CPU took 0.9-3.3 s of wall time, and the decision after a move came 73-84
steps later, where it found the next window +8-9% (+11-12% twice as wide) and had to wait for a second look that the
200-step run did not reach (auto stayed at ``k = 5-6, j = 3``, 1.04-1.14x the fixed ``k = 8`` and ``12``). A reply
without ``decide_cpu_s`` (an older child) is counted by its wall time.
A child that cannot start, dies or answers with an error leaves the hook deciding on the learner's thread again,
said once. Drift over ``algorithm.offpolicy_budget`` is never left to this process: the hook checks it on the
learner's thread at every due step (a mean over a few records) and narrows at once; a decision in flight, judged
at the old window, is then ignored.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Optional

#: The largest share of wall time the decision process may be busy, counted in its CPU time (module docstring).
SHARE = 0.1
#: While the window climbs: the share after a decision that widened it on a predicted gain of at least CLIMB_GAIN.
CLIMB_SHARE, CLIMB_GAIN = 0.5, 0.25
#: Consecutive decisions that stay (no move, none pending) halve the share this many times at most.
STAY_HALVINGS = 3
#: How much nicer than the learner the decision process runs (module docstring, "Why niced").
NICE = 10


def share_after(reply: dict, share: float = SHARE) -> float:
    """The share of wall time the cool-down after the decision ``reply`` (:func:`asyncppo.pipeline.tuner.decide_on`)
    allows: :data:`CLIMB_SHARE` after a widening on a predicted gain of at least :data:`CLIMB_GAIN` (the window is
    climbing), else ``share``; a climb up the rungs that ended (``settled``: the next rung stopped paying, or the
    cap) is no longer climbing."""
    move, at = reply.get("move"), reply.get("at")
    climbing = bool(move) and at is not None and len(move) > 3 and move[0] + move[1] > at[0] + at[1] \
        and float(move[3]) >= CLIMB_GAIN and not reply.get("settled", False)
    return max(share, CLIMB_SHARE) if climbing else share


class DecisionHost:
    """The learner's end: :meth:`submit` a tuner state when :meth:`ready`, :meth:`poll` for the reply."""

    def __init__(self, share: float = SHARE):
        self.share = share
        # the learner's own import path: the child imports the same asyncppo (a worktree, a Ray actor's code path)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncppo.pipeline.tuner_host"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.replies: queue.Queue = queue.Queue()
        self.busy = False
        self.not_before = 0.0
        self.failed: Optional[str] = None
        self.decisions = 0
        self.stays = 0  # decisions in a row that found nothing to do (the share halves with each: module docstring)
        self._stale = False  # the decision in flight judged a window the drift budget has since moved
        self._cost = self._replied = 0.0  # the last reply's decision cost, and when it came
        self._reader = threading.Thread(target=self._read, name="tuner-host-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                self.replies.put({"error": f"not JSON: {line[:80]!r}"})
        self.replies.put({"error": f"the decision process exited (code {self.proc.wait()})"})

    def ready(self) -> bool:
        """Nothing in flight, the cool-down over, the child alive."""
        return self.failed is None and not self.busy and time.monotonic() >= self.not_before

    def submit(self, state: dict, idle: bool = False) -> None:
        """Send ``state`` for a decision; ``idle``: the process enters the idle class first, for good (module
        docstring, "Why the idle class")."""
        try:
            self.proc.stdin.write(json.dumps({"tuner": state, "idle": bool(idle)}) + "\n")
            self.proc.stdin.flush()
            self.busy = True
        except (OSError, ValueError) as exc:
            self.failed = f"cannot write to the decision process ({exc})"

    def poll(self) -> Optional[dict]:
        """The reply to the decision in flight, once it came (``error``: the host failed, :attr:`failed` says why)."""
        try:
            reply = self.replies.get_nowait()
        except queue.Empty:
            return None
        self.busy = False
        if "error" in reply:
            self.failed = str(reply["error"])
            return reply
        self.decisions += 1
        if not self._stale:  # a reply on a window no longer in force says nothing of the one now (it is ignored)
            self.stays = 0 if reply.get("move") or reply.get("pending", True) else self.stays + 1
        self._stale = False
        self._cost = float(reply.get("decide_cpu_s", reply.get("decide_s", 0.0)))  # CPU: module docstring
        self._replied = time.monotonic()
        self.not_before = self._cooled(self.share / 2 ** min(self.stays, STAY_HALVINGS))
        return reply

    def _cooled(self, share: float) -> float:
        """When the cool-down after the last reply ends at ``share`` of the wall time: its cost, ``1 / share - 1``
        times over, after it came."""
        return self._replied + self._cost * (1.0 / share - 1.0)

    def moved(self) -> None:
        """The window moved without a decision (the drift budget, the opening): the back-off after decisions that
        stayed ends; the next decision may come after the plain share's cool-down of the last one, and the one in
        flight, if any, judged the old window: its reply counts neither as a stay nor as a move."""
        self._stale = self.busy
        if self.stays:
            self.stays = 0
            self.not_before = min(self.not_before, self._cooled(self.share))

    def taken(self, reply: dict) -> None:
        """``reply``'s move was put in force: when it widened the window on a large predicted gain, the cool-down
        after it shortens to :func:`share_after`'s climbing share (a reply judged at a window no longer in force,
        and so ignored, keeps the tenth)."""
        self.stays = 0
        share = share_after(reply, self.share)
        if share > self.share:
            self.not_before = self._cooled(share)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def idle_class() -> bool:
    """Put this process in Linux's ``SCHED_IDLE`` class (module docstring, "Why the idle class"); False where the
    platform has none or refuses, and the process keeps its nice value."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


def main() -> None:
    """The child: one JSON state in per line, one JSON reply out (:func:`asyncppo.pipeline.tuner.decide_on`)."""
    from asyncppo.pipeline.tuner import decide_on

    try:
        os.nice(NICE)
    except (AttributeError, OSError):  # a platform without it, or a refusal: decide at the learner's priority
        pass
    idle = False
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # anything printed by the simulation stays out of the replies
    for line in sys.stdin:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            request = json.loads(line)
            if request.get("idle") and not idle:
                idle = idle_class() or True  # asked once: a platform without the class keeps its nice value
            reply = decide_on(request["tuner"])
        except Exception as exc:  # one bad decision is the learner's to handle: it decides itself from then on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["decide_s"] = time.perf_counter() - t0
        reply["decide_cpu_s"] = time.process_time() - c0
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
