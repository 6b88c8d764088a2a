"""Accuracy-against-time curves of two contenders, and the time each needs to reach an accuracy.

Pure Python (no torch), so ``tests/unit/test_bench_curves.py`` checks it with hand-computed numbers. A curve is a
list of ``(seconds, accuracy)`` points in time order, the first one normally the shared start (``0 s``, the model
before training). Between two scored points the curve is taken as the straight line joining them (linear
interpolation): the points are minutes apart and nothing is known in between, so a step function would credit a
contender only at its next scoring point and make the answer depend on where the points fall.
"""

from __future__ import annotations

from typing import Optional, Sequence

Curve = Sequence[tuple[float, float]]


def time_to_reach(curve: Curve, threshold: float) -> Optional[float]:
    """The first time the (linearly interpolated) curve is at or above ``threshold``; None if it never is.

    A curve that starts at or above the threshold reaches it at its first point's time."""
    if not curve:
        return None
    times = [t for t, _ in curve]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"curve times must not decrease: {times}")
    t0, a0 = curve[0]
    if a0 >= threshold:
        return float(t0)
    for (t1, a1) in curve[1:]:
        if a1 >= threshold:  # crossed between (t0, a0) and (t1, a1), a0 < threshold <= a1
            return t0 + (threshold - a0) / (a1 - a0) * (t1 - t0)
        t0, a0 = t1, a1
    return None


def compare(curves: dict[str, Curve], fast: str, slow: str, threshold: Optional[float] = None) -> dict:
    """Final accuracies, the threshold (default: the lower of the two finals), the time each contender first
    reached it, and ``speedup`` = slow's time / fast's time (how many times sooner ``fast`` got there).

    With the default threshold both curves reach it (at their last point at the latest); with another one a
    contender may never reach it: its time is None, and so is ``speedup`` (``inf`` when only ``slow`` never did).
    ``speedup`` is None too when both were at the threshold at 0 s (the start already met it, so there is
    nothing to time), and ``inf`` when only ``fast`` was."""
    finals = {name: curve[-1][1] for name, curve in curves.items() if curve}
    if set(finals) != {fast, slow}:
        raise ValueError(f"need non-empty curves of {fast!r} and {slow!r}, got {sorted(finals)}")
    threshold = min(finals.values()) if threshold is None else threshold
    reached = {name: time_to_reach(curves[name], threshold) for name in (fast, slow)}
    t_fast, t_slow = reached[fast], reached[slow]
    if t_fast is None or (t_fast == 0 and t_slow == 0):
        speedup = None
    elif t_slow is None or t_fast == 0:
        speedup = float("inf")
    else:
        speedup = t_slow / t_fast
    return {"finals": finals, "threshold": threshold, "reached": reached, "speedup": speedup}
