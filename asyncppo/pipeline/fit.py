"""Fitting a straight line to logged timings: how ``asyncppo advise`` (report/rates.py) and the in-run window tuner
(:mod:`asyncppo.pipeline.tuner`) both turn per-step metrics into the model's engine and learner speeds, so that the
two never disagree about what a run measured."""

from __future__ import annotations


def fit_line(xs: list[float], ys: list[float], ws: list[float], what: str, notes: list[str]) -> tuple[float, float]:
    """(intercept, slope) of y against x by least squares weighted by ``ws`` (how many events each point averages),
    so the fitted line reproduces the *total* time, disturbed steps included: on a shared machine the run's own
    throughput paid for them too. Proportional (ratio of sums) when x hardly varies or the line is unphysical."""
    pts = [(x, y, w) for x, y, w in zip(xs, ys, ws) if w > 0 and x > 0]
    if not pts:
        raise ValueError(f"the run logged nothing to measure {what} from")
    sw = sum(w for _, _, w in pts)
    ratio = sum(w * y for _, y, w in pts) / sum(w * x for x, _, w in pts)
    lo, hi = min(p[0] for p in pts), max(p[0] for p in pts)
    if hi / lo < 1.5:
        notes.append(f"{what}: x varied only from {lo:.3g} to {hi:.3g}; fitted as proportional (no fixed cost)")
        return 0.0, ratio
    xbar = sum(w * x for x, _, w in pts) / sw
    ybar = sum(w * y for _, y, w in pts) / sw
    sxx = sum(w * (x - xbar) ** 2 for x, _, w in pts)
    slope = sum(w * (x - xbar) * (y - ybar) for x, y, w in pts) / sxx
    intercept = ybar - slope * xbar
    if slope < 0 or intercept < 0:  # noise: fall back to the proportional fit, which is never negative
        notes.append(f"{what}: the line fit was not physical (intercept {intercept:.3g}, slope {slope:.3g}); "
                     "fitted as proportional")
        return 0.0, ratio
    return intercept, slope
