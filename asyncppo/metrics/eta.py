"""The time a run has left, for the progress line: ``step 61/180 |    123s | eta 4m58s | ...``.

Why from the records' own training clock (``time/wall_s``) and a recent window: the first steps of a run wait for
the pipeline to fill and a resumed or restarted learner starts a new clock, so neither the elapsed time since the
command started nor the run's average says how fast it goes now. The rate is the last ``window`` steps' training
time over their number, and a clock that went back (a new learner process) starts the window again.
"""

from __future__ import annotations

import collections
from typing import Optional


class StepRate:
    """Seconds per step over the last ``window`` steps, fed one ``(step, wall_s)`` point per metrics record."""

    def __init__(self, window: int = 20):
        self._points: collections.deque = collections.deque(maxlen=max(1, int(window)) + 1)

    def add(self, step: int, wall_s) -> None:
        """One record's step and training clock; a record without a clock (or a non-number) is ignored."""
        if not isinstance(wall_s, (int, float)) or isinstance(wall_s, bool):
            return
        if self._points and (step <= self._points[-1][0] or wall_s < self._points[-1][1]):
            self._points.clear()  # a restarted learner: its clock and steps start again
        self._points.append((int(step), float(wall_s)))

    def seconds_per_step(self) -> Optional[float]:
        if len(self._points) < 2:
            return None
        (s0, w0), (s1, w1) = self._points[0], self._points[-1]
        return (w1 - w0) / (s1 - s0)

    def eta_s(self, total_steps: Optional[int]) -> Optional[float]:
        """Seconds until ``total_steps`` at the recent rate; None without a total or before two points."""
        rate = self.seconds_per_step()
        if rate is None or not total_steps:
            return None
        return max(0, total_steps - self._points[-1][0]) * rate


def format_duration(seconds: float) -> str:
    """``45s``, ``4m05s``, ``1h12m``, ``2d03h``: short enough for a progress line, exact enough to plan by."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
