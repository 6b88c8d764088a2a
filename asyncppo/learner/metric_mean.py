"""Averaging an update's per-micro-batch metrics into one record per learner step."""

from __future__ import annotations

import math
from collections import defaultdict


class MetricMean:
    """Token-weighted mean of per-micro-batch metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for key, value in metrics.items():
            value = float(value.item() if hasattr(value, "item") else value)
            if not math.isfinite(value):  # undefined for this micro-batch (e.g. explained variance of constants)
                continue
            if key.endswith("_max") or key.endswith("/max"):
                self.maxes[key] = max(self.maxes.get(key, value), value)
            elif key.endswith("_min") or key.endswith("/min"):
                self.maxes[key] = min(self.maxes.get(key, value), value)
            else:
                self.sums[key] += value * weight
                self.weights[key] += weight

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / max(self.weights[k], 1e-12) for k in self.sums}
        out.update(self.maxes)
        return out
