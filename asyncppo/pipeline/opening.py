"""The auto window's opening move: one jump by Little's law, before the model has a fit worth simulating.

Why a rule without the model at the start: the tuner's first decision (:mod:`asyncppo.pipeline.tuner`) needs a few
steps of rates, then runs in a niced process of its own (tuner_host.py), so on the guess game behind a 200 ms tool
(60 steps, started at the default ``k = 1``, best fixed windows 8-16) it was submitted at step 5 and put in force
at step 9. Those 9 steps at ``k = 1``, each about twice as long as a step at ``k = 8`` (the learner waited for
groups 72% of the time), were most of auto's 1.20-1.34x the best fixed window's learner time. What a run measures
from its first steps already says how far off it is:

* the learner's **wait share** ``w`` (``time/wait_s`` over ``time/step_s``): the pipeline delivers groups ``1 - w``
  times as fast as the learner could take them;
* the engine's **use** ``u`` (``util/rollout_busy`` times ``rollout/occupancy``: the share of its slots decoding
  over the wall time): what it could take on before it is the slow side.

Where the groups' time is latency (a tool's wait, a long tail decoding few sequences) rather than the engine's
capacity, throughput is work in flight over latency (Little's law): ``1 / (1 - w)`` times the groups in flight
would keep the learner busy, and the engine has room for ``1 / u`` times the work. Groups in flight grow with the
lookahead (``j + 1`` batches admitted ahead) and tokens may be as old as ``k``, so the opening scales ``j + 1`` and
``k + 1`` by ``f = min(1 / (1 - w), 1 / u, MAX_FACTOR)``, rounded up, within the cap. Measured before it was built,
at the start window: the guess game at ``k = 1`` (steps 2-3) ``w = 0.72``, ``u = 0.07``: ``f = 3.6``, ``k = 1 -> 7``;
``data=long`` at ``k = 2`` (steps 2-5) ``w = 0.56``, ``u = 0.26``: ``k = 2 -> 6``; ``data=long`` at its preset
``k = 12`` ``w = 0.15``, ``u = 0.94``: no move (nor at ``k = 8``, ``u = 0.9``); the default task at ``k = 1``
``w = 0.05``: no move.

It is one move at most, judged after the first step alone where the engine sat idle through it (:data:`FILL_USE`),
then after the second and the fourth step past the first (:data:`OPEN_READS`), on the learner's thread (a few
arithmetic operations), and only upward. Why the first step too: a move at the third step put the new window's
groups in front of the learner at its fifth, so the guess game waited for one group's latency twice (steps 1-5 took
5.2-5.4 s against 2.7-3.0 s at a fixed ``k = 8`` or ``16``: 2.4-2.6 s of auto's 2.5-6.5 s over the best
fixed window). The first step's reading (guess ``w = 0.84``, ``u = 0.11``; ``data=reverse`` at ``k = 1``
``w = 0.70-0.73``, ``u = 0.13-0.21``; ``data=long`` at ``k = 2`` ``w = 0.8``, ``u = 0.10-0.15``) gives about the window
the later readings gave, two steps sooner.

What the fill says of ``j`` differs from a later step's reading. The learner waited one group's latency ``L`` for
its first batch and then trained it for ``c``, so ``w = L / (L + c)``: keeping it busy takes a batch arriving every
``c``, that is ``L / c`` batches in production and the one in training, ``1 / (1 - w)`` batches in flight whatever
``j`` was (the later readings' ``1 / (1 - w)`` is a factor on the ``j + 1`` in force, whose batches shared the
wait). So the fill sets ``j + 1`` to ``1 / (1 - w)`` (at most :data:`MAX_FACTOR` times what it was; where ``j`` follows
``k``, as an unset lookahead, it takes ``k``'s value instead, and where ``j`` already holds the count the fill does
not move) and scales
``k + 1``, the age a group may reach in steps, by the factor as the later readings do: once the learner stops
waiting its steps are ``1 / (1 - w)`` times shorter, and the same latency spans as many times more of them. Scaling
``j + 1`` by the factor too (``k = j = 6-7`` on ``data=reverse``) trained at a mean lag of 5.3-5.6 against 2.5 at
the fixed ``k = 8, j = 3`` for the same learner time, with ``actor/mismatch_kl`` 3-5x theirs and held-out reward
0.07-0.10 under theirs on two of three seeds; the count gives ``j = 3`` there, the guess game ``j = 6``. Only upward,
because a window too
narrow costs every step until the model's first decision, while one a little too wide costs lag, which that decision
(which may narrow) and the drift budget handle. It does not move where the learner waits less than
:data:`MIN_WAIT` of its time or ``f`` is under :data:`MIN_FACTOR` (a window near right stays for the model to judge),
nor where the measured drift is over half the budget, as a leap would not; and, as a climb's rungs, to no ``k`` that
would scale the measured drift past the budget (``drift x k_new / k``). Only where ``j`` may grow (auto, or following
``k``): with the lookahead pinned, a wider ``k`` admits no group sooner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

#: After how many records (the run's first left out: the pipeline's fill from empty, not its rate) the opening is
#: judged, on all of them: two show a steady wait at once (the guess game), four smooth a long tail's bursts
#: (``data=long`` at ``k = 2``: steps 2-3 waited 0 s, steps 2-5 56% of the time). It moves at most once.
OPEN_READS = (2, 4)
#: The learner must wait at least this share of its steps: below it, the pipeline is near the learner's pace.
MIN_WAIT = 0.25
#: A jump smaller than this factor is left to the model (it is within what one of its decisions judges).
MIN_FACTOR = 1.5
#: The most one opening multiplies the work in flight by (the reading is four steps of a run's start).
MAX_FACTOR = 4.0
#: The run's first step (the fill from empty) is read alone, before :data:`OPEN_READS`, only where the engine sat at
#: most this share used through it: there the start is bound by latency with room for the whole :data:`MAX_FACTOR`.
#: Every window pays the fill's wait, so elsewhere it says nothing about the window (``data=reverse`` at ``k = 8``
#: waited 61% of its first step with the engine 57% used).
FILL_USE = 1.0 / MAX_FACTOR


@dataclass(frozen=True)
class Reading:
    """What the opening read: the learner's wait share, the engine's use, and the factor they allow."""
    wait: float
    use: Optional[float]  # None: the records carry no engine meter (the factor is the wait's alone)
    factor: float


def read(records: list[dict]) -> Optional[Reading]:
    """The wait share (time-weighted), the engine's use (mean over the records) and ``f`` (module docstring) from
    ``records``; None when they lack the learner's times."""
    timed = [r for r in records if isinstance(r.get("time/step_s"), (int, float))
             and isinstance(r.get("time/wait_s"), (int, float)) and r["time/step_s"] > 0]
    if not timed:
        return None
    wait = min(1.0, sum(float(r["time/wait_s"]) for r in timed) / sum(float(r["time/step_s"]) for r in timed))
    metered = [float(r["util/rollout_busy"]) * float(r["rollout/occupancy"]) for r in timed
               if isinstance(r.get("util/rollout_busy"), (int, float))
               and isinstance(r.get("rollout/occupancy"), (int, float))]
    use = sum(metered) / len(metered) if metered else None
    factor = min(1.0 / max(1.0 - wait, 1e-9), MAX_FACTOR)
    if use is not None:
        factor = min(factor, 1.0 / max(use, 1e-9))
    return Reading(wait, use, factor)


def scaled(k: int, j: int, factor: float, *, cap: int, tune_k: bool, tune_j: bool, tie_j: bool,
           j_factor: Optional[float] = None) -> tuple[int, int]:
    """The window with its work in flight scaled by ``factor``: ``j + 1`` (where ``j`` is auto) and ``k + 1`` (where
    ``k`` is auto) times ``factor`` (``j + 1`` by ``j_factor`` where given: the fill's own count, :func:`opening`),
    rounded up; ``k`` at most ``cap`` and never under ``j``, ``j`` never over ``k``. A pinned knob keeps its value."""
    grow = lambda x, f: int(math.ceil((x + 1) * f - 1e-9)) - 1  # noqa: E731
    k2 = min(cap, max(k, grow(k, factor))) if tune_k else k
    if tie_j:
        return k2, k2
    return k2, (min(k2, max(j, grow(j, factor if j_factor is None else j_factor))) if tune_j else j)


def opening(records: list[dict], k: int, j: int, *, cap: int, tune_k: bool, tune_j: bool, tie_j: bool,
            valid, fill: bool = False) -> Optional[tuple[int, int, str]]:
    """The opening move on ``records``, the run's records after its first (``fill``: the first alone, read only
    where the engine was at most :data:`FILL_USE` used): ``(k, j, reason)``, or None where it stays (module
    docstring), or where ``j`` cannot grow (pinned): a wider ``k`` alone admits no group sooner, so it adds lag, not
    work in flight. ``valid(k, j)`` says whether the tuner may hold a window."""
    if not (tune_j or tie_j):
        return None
    got = read(records)
    if got is None or got.wait < MIN_WAIT or got.factor < MIN_FACTOR:
        return None
    j_factor = None
    if fill:
        if got.use is None or got.use > FILL_USE:
            return None
        # the batches in flight that keep the learner busy: 1 / (1 - w) (module docstring), whatever j was
        j_factor = min(1.0 / max(1.0 - got.wait, 1e-9) / (j + 1), MAX_FACTOR)  # 1 / u >= MAX_FACTOR here
    k2, j2 = scaled(k, j, got.factor, cap=cap, tune_k=tune_k, tune_j=tune_j, tie_j=tie_j, j_factor=j_factor)
    if (k2, j2) == (k, j) or not valid(k2, j2):
        return None
    if fill and not tie_j and j2 == j:
        return None  # j already holds the fill's count: the learner's steps will not shorten, so neither does k's age
    use = "" if got.use is None else f", engine {got.use:.0%} used"
    what = "its first step (the fill)" if fill else "its steps"
    if fill and not tie_j:
        return k2, j2, (f"opening: learner waiting {got.wait:.0%} of {what}{use}; age limit "
                        f"x{got.factor:.1f}, {j2 + 1} batches in flight (Little's law)")
    return k2, j2, (f"opening: learner waiting {got.wait:.0%} of {what}{use}; "
                    f"work in flight x{got.factor:.1f} (Little's law)")
