"""``rollout.sync_every=auto``: the learner steps between two weight pushes, set at every step from what the run
measures.

Why a push every step is not always best: an engine takes pushed weights between two decode steps and decodes
nothing while it loads them (rollout/worker.py, ``_update_weights``; the advisor's ``load_s``). Where the learner's
steps are short against a load, a push every step keeps the engines loading for a large share of the wall time.
Measured on ``data=reverse`` (2 cores): steps of ~0.07-0.15 s against loads of ~0.02 s, so a push every step
takes the engine 14-30% of its time; that is why its benchmarks push every 2 steps (``rollout.sync_every=2``), a
number chosen by hand. Where steps are long against a load (``data=long``: 3 s steps, 0.02 s loads), a push every
step costs the engines under 1% and keeps the samples one version fresher. The right cadence is a ratio of two
rates the run measures, so it need not be a knob.

The rule: ``s = ceil(load / (DUTY * step))``, the fewest steps between pushes that keep the engines' loads within
:data:`DUTY` of the wall time. ``load`` is the median of the last :data:`WINDOW` loads measured (``sync/load_s``: per
step the slowest engine's time receiving and loading the weights, when it decodes nothing; ``sync/push_s`` where a
workload reports no such figure, the embodied runners: from the announcement seen to the weights loaded, a little
more); ``step`` the median of the learner's
last :data:`WINDOW` step times (``time/step_s``). ``s`` is at least 1 and at most ``max(1, j)``, ``j`` the smallest
admission lookahead a ticket still outstanding may carry (under an auto window, the smallest it ever held: a ticket
keeps the lookahead of its grant). Why at most ``j``: a ticket granted at version ``v`` needs weights no older than
``v - j``, so pushes further apart than ``j + 1`` steps would leave the next batch's tickets waiting for weights the
learner holds back, a hang (the check ``admission_lookahead >= sync_every - 1`` refuses a fixed cadence that does
it); at ``j + 1`` the newest tickets wait for every push, so one step less. Before any load is measured, 1: the
first pushes are the measurement.

What it does not touch: the staleness bound is enforced by admission and ticket order, whatever the cadence
(docs/staleness.md), so a cadence that moves every step is safe; only the lag it adds (up to ``s - 1`` versions, well
within ``j``) changes. A push skipped under ``rollout.coalesce_pushes`` is still owed and goes out at the next step
it may, as with a fixed cadence.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Optional

from asyncppo.pipeline.fit import load_of

#: The largest share of the wall time the engines may spend loading pushed weights.
DUTY = 0.1
#: Steps whose loads and times are read (medians: one slow load or step does not move the cadence).
WINDOW = 10


def cadence(load_s: float, step_s: float, lookahead: int, duty: float = DUTY) -> int:
    """The steps between two pushes (module docstring): ``ceil(load_s / (duty * step_s))`` within ``[1, max(1,
    lookahead)]``; 1 where nothing is measured yet (a load or a step of zero)."""
    if load_s <= 0 or step_s <= 0:
        return 1
    return max(1, min(max(1, lookahead), math.ceil(load_s / (duty * step_s) - 1e-9)))


def _median(xs) -> float:
    """The median of ``xs``; 0 when there is none (nothing measured yet)."""
    return statistics.median(xs) if xs else 0.0


class PushCadence:
    """Feeds on the learner's step records (:meth:`observe`); :meth:`every` is the cadence in force."""

    def __init__(self, duty: float = DUTY, window: int = WINDOW):
        self.duty = duty
        self.loads: collections.deque = collections.deque(maxlen=window)
        self.steps: collections.deque = collections.deque(maxlen=window)
        self.last: int = 1  # the cadence the last step used (the console says when it changes)
        self.range = [1, 1]  # the fewest and most steps between pushes the run used (the summary's)

    def observe(self, record: dict) -> None:
        """One step's record: its time, and the slowest engine's load where one was measured in it."""
        step, load = record.get("time/step_s"), load_of(record)
        if isinstance(step, (int, float)) and step > 0:
            self.steps.append(float(step))
        if load is not None:
            self.loads.append(load)

    def every(self, lookahead: int) -> int:
        """The steps between pushes now, for the smallest lookahead ``lookahead`` an outstanding ticket may carry."""
        return cadence(_median(self.loads), _median(self.steps), lookahead, self.duty)

    def used(self, s: int) -> Optional[str]:
        """Record that ``s`` is the cadence in force; a line for the console when it changed, else None."""
        old, self.last = self.last, s
        self.range = [min(self.range[0], s), max(self.range[1], s)]
        if s == old:
            return None
        return (f"weight push every {old} -> {s} step(s): engines load in {_median(self.loads):.3f} s (median), "
                f"steps take {_median(self.steps):.3f} s; loads kept within {self.duty:.0%} of the time "
                "(rollout.sync_every=auto)")
