"""Accuracy-against-time curves of two contenders, and the time each needs to reach an accuracy.

Pure Python (no torch), so ``tests/unit/test_bench_curves.py`` checks it with hand-computed numbers. Used by the
peer benchmark (asyncppo/bench/peer_long.py) and its picture (plot_peer.py). A curve is a
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


def first_scored(curve: Curve, threshold: float) -> Optional[float]:
    """The time of the first scored point (the start left out) at or above ``threshold``: the conservative reach,
    which does not assume the curve rose in a straight line from the start."""
    return next((t for t, a in curve[1:] if a >= threshold), None)


def last_below(curve: Curve, threshold: float) -> float:
    """The time of the last point before the curve first reaches ``threshold`` (the start included), or of its last
    point if it never does: the latest moment the slower contender is known not to have got there yet."""
    before = curve[0][0]
    for t, a in curve:
        if a >= threshold:
            return before
        before = t
    return before


def reach_ratio(curves: dict[str, Curve], fast: str, slow: str, threshold: float) -> dict:
    """How many times sooner ``fast`` reached ``threshold`` than ``slow``, two ways (issue #48):

    * ``conservative``: the slower side's last point still below the threshold over the faster side's first scored
      point at or above it, so neither side is credited between points; when ``slow`` never reaches it, its last
      point (its clock's budget) stands in and the ratio is a lower bound (``slow_reached`` False: "not reached in
      S s", counted, not left undefined);
    * ``interpolated``: the linear crossing of each curve (:func:`time_to_reach`), the slower side's last point
      again standing in when it never reaches it.

    When ``fast`` never reaches the threshold both ratios are 0.0: it did not get there, whatever ``slow`` did.
    ``None`` where the start already met the threshold (nothing to time)."""
    f, s = curves[fast], curves[slow]
    if f[0][1] >= threshold:
        return {"conservative": None, "interpolated": None, "fast_s": 0.0, "slow_s": 0.0, "slow_reached": True}
    t_fast, t_slow_interp = first_scored(f, threshold), time_to_reach(s, threshold)
    slow_reached = t_slow_interp is not None
    t_slow = last_below(s, threshold)
    if t_fast is None:
        return {"conservative": 0.0, "interpolated": 0.0, "fast_s": None, "slow_s": t_slow,
                "slow_reached": slow_reached}
    interp_fast = time_to_reach(f, threshold)
    interp_slow = t_slow_interp if slow_reached else s[-1][0]
    return {"conservative": t_slow / t_fast, "interpolated": interp_slow / interp_fast if interp_fast else None,
            "fast_s": t_fast, "slow_s": t_slow, "slow_reached": slow_reached}


def curves_of(doc: dict, metric: str = "sampled") -> dict[str, list[tuple[float, float]]]:
    """Each contender's ``(training s, accuracy)`` points of a peer record (``bench_peer_long.json``: the shared
    ``start`` and each result's scored ``points``), the shared start first."""
    start = doc["start"][metric]
    return {r["name"]: [(0.0, start)] + [(p["train_s"], p[metric]) for p in r["points"]] for r in doc["results"]}


DELTAS = (0.05, 0.10)  # the thresholds above the start that issue #48 fixed in advance


def peer_figures(doc: dict, fast: str = "asyncppo", slow: str = "trl") -> dict[str, Optional[float]]:
    """The figures of one seed's peer record: the start and finals, the old measure (the time to the lower of the two
    finals: interpolated, at scored points, and conservative) and, for each threshold start + delta of :data:`DELTAS`, the
    conservative and interpolated ratios of :func:`reach_ratio`; ``conservative speedup, worst threshold`` is the
    smaller conservative ratio, the one the target is set on (None where either is undefined)."""
    curves = curves_of(doc)
    start = doc["start"]["sampled"]
    out: dict[str, Optional[float]] = {"start sampled": start}
    for name, curve in curves.items():
        out[f"final sampled {name}"] = curve[-1][1]
    if not {fast, slow} <= set(curves):
        return out
    c = compare(curves, fast=fast, slow=slow)
    out["speedup to lower final, interpolated"] = None if c["speedup"] == float("inf") else c["speedup"]
    scored, t_slow = first_scored(curves[fast], c["threshold"]), c["reached"][slow]
    defined = c["speedup"] is not None and scored and t_slow is not None  # undefined when the start met it
    out["speedup to lower final, at scored points"] = t_slow / scored if defined else None
    # issue 48's reading of the same runs: the slower side's last point below the lower final, not its crossing
    out["speedup to lower final, conservative"] = last_below(curves[slow], c["threshold"]) / scored if defined \
        else None
    worst: list[Optional[float]] = []
    for delta in DELTAS:
        r = reach_ratio(curves, fast, slow, start + delta)
        out[f"conservative speedup start+{delta:.2f}"] = r["conservative"]
        out[f"interpolated speedup start+{delta:.2f}"] = r["interpolated"]
        worst.append(r["conservative"])
    out["conservative speedup, worst threshold"] = None if None in worst else min(worst)
    return out
