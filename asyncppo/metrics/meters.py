"""Small accumulators for throughput, utilisation and staleness metrics.

They are deliberately dumb (no threads, no I/O) so that the learner loop can update them inline and the numbers mean
exactly what their names say: a busy fraction is seconds spent working divided by wall seconds elapsed.
"""

from __future__ import annotations

import time
from typing import Iterable


class BusyMeter:
    """Fraction of wall time spent inside ``busy()`` blocks since the last ``reset``."""

    def __init__(self) -> None:
        self._busy = 0.0
        self._start = time.perf_counter()

    def add(self, seconds: float) -> None:
        self._busy += max(0.0, seconds)

    def fraction(self, workers: int = 1) -> float:
        wall = time.perf_counter() - self._start
        return min(1.0, self._busy / max(wall * max(workers, 1), 1e-9))

    def reset(self) -> None:
        self._busy = 0.0
        self._start = time.perf_counter()


class RateMeter:
    """Count per wall second since the last ``reset``."""

    def __init__(self) -> None:
        self._count = 0.0
        self._start = time.perf_counter()

    def add(self, n: float) -> None:
        self._count += n

    def rate(self) -> float:
        return self._count / max(time.perf_counter() - self._start, 1e-9)

    def reset(self) -> None:
        self._count = 0.0
        self._start = time.perf_counter()


def lag_stats(learner_version: int, version_mins: Iterable[int], prefix: str = "staleness") -> dict[str, float]:
    """min / mean / max of ``learner_version - version_min`` (Sample Factory style policy lag)."""
    lags = [learner_version - v for v in version_mins]
    if not lags:
        return {f"{prefix}/min": 0.0, f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/min": float(min(lags)),
        f"{prefix}/mean": float(sum(lags) / len(lags)),
        f"{prefix}/max": float(max(lags)),
    }
