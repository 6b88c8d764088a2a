"""How long a rollout worker may make no progress before it is hung, and how long a weight push may take.

Why a rule and not a constant: ``cluster.timeout_s`` (600 s) is the deadline of a *failure* that ends the run, sized
for the slowest legitimate wait (an engine start-up on a loaded machine, a first push of a large model). A hung
worker is instead replaced and the run goes on, so the shorter its deadline, the fewer steps wait for its tickets;
but a false alarm kills a healthy worker and costs an engine start-up. The auto value therefore scales with how
long the run's steps actually take: a worker that has made no decode step for ten learner steps is far outside
what any legitimately slow generation does, and the floor keeps a run whose steps take a second from calling a
worker hung over a pause of a few seconds (a garbage collection, a loaded machine). Both ends are clamped to
``cluster.timeout_s``: the hang deadline never outlasts the one that ends the run.

The silent deadline (``cluster.silent_timeout_s``) is not a rule of this kind: it bounds how long a worker may answer
*nothing at all* while the learner and its peers answer every few seconds (launch/hang.py, rule 3). A busy worker
still answers, because another thread of its actor does; so the bound is fixed (15 s by default), short enough to find
a stopped process in well under the 20 s the run may lose to it, long enough that a live worker on a loaded 2-core
machine is far from it (its answers came at most 2.0-2.1 s apart, the ping period, in every launch measured for
docs/reliability.md). It never exceeds the hang timeout.

Both the launcher (launch/hang.py, which pings the workers) and the learner (learner/loop.py, which bounds each push)
resolve the value with the same rule from the same measurements, so the two agree without talking about it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Optional

# Never call a worker hung before this many seconds without progress (auto mode).
HANG_FLOOR_S = 60.0
# Auto mode: this many median learner steps without progress make a worker hung.
HANG_STEPS = 10.0
# cluster.silent_timeout_s's default: seconds a worker may answer no ping at all while its peers answer.
SILENT_S = 15.0


def hang_timeout(configured: Optional[float], step_seconds: Sequence[float], timeout_s: float) -> float:
    """``cluster.hang_timeout_s``: the configured value, or (null) ``max(HANG_FLOOR_S, HANG_STEPS x median step
    seconds)``, at most ``timeout_s``. ``step_seconds`` are the learner's recent step durations (none yet: the
    floor)."""
    if configured is not None:
        return min(float(configured), float(timeout_s))
    median = statistics.median(step_seconds) if step_seconds else 0.0
    return min(max(HANG_FLOOR_S, HANG_STEPS * median), float(timeout_s))


def push_timeout(configured: Optional[float], hang_configured: Optional[float], step_seconds: Sequence[float],
                 timeout_s: float) -> float:
    """``cluster.push_timeout_s``: the configured value, or (null) the hang timeout, at most ``timeout_s``."""
    if configured is not None:
        return min(float(configured), float(timeout_s))
    return hang_timeout(hang_configured, step_seconds, timeout_s)


def silent_timeout(configured: Optional[float], hang_s: float) -> Optional[float]:
    """``cluster.silent_timeout_s`` at most the hang timeout ``hang_s``; None (null): no silent rule, a worker that
    answers nothing is hung after the hang timeout only."""
    return None if configured is None else min(float(configured), float(hang_s))
