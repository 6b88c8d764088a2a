"""The limit of a two-sided pipeline and how close a run comes to it.

A pipeline of a generator and a trainer can never finish ``N`` samples faster than its slower side does alone, at
full speed, on its own devices: the engine generating the ``N`` samples with every slot busy, or the learner
training them with nothing to wait for. So ``limit = max(engine alone, learner alone)`` and a run's
``efficiency = limit / its time``: 1.0 is perfect overlap, with no pause on the slower side.

Why not the "ideal overlap" of a synchronous run's own breakdown (its training time): that number keeps whatever
the synchronous run did badly (an engine running far below its slots, a learner sharing its process with
sockets), and a pipeline can beat it without being any good. The limit is measured on each side alone
(rollout/engine_alone.py, learner/learner_alone.py; asyncppo/bench/limit.py runs both).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PipelineLimit:
    """Each side alone on the same ``samples``: seconds, and the engine's occupancy while it ran."""

    engine_s: float
    learner_s: float
    samples: int
    engine_occupancy: float = math.nan

    def __post_init__(self) -> None:
        for name in ("engine_s", "learner_s"):
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"pipeline limit: {name}={value!r} must be a positive number of seconds")

    @property
    def limit_s(self) -> float:
        return max(self.engine_s, self.learner_s)

    @property
    def slower_side(self) -> str:
        return "engine" if self.engine_s >= self.learner_s else "learner"

    def efficiency(self, pipeline_s: float) -> float:
        """``limit / pipeline_s`` for a run that took ``pipeline_s`` seconds on the same samples."""
        if not pipeline_s > 0:
            raise ValueError(f"pipeline limit: the run's time {pipeline_s!r} must be a positive number of seconds")
        return self.limit_s / pipeline_s

    def as_dict(self) -> dict:
        return {**asdict(self), "limit_s": self.limit_s, "slower_side": self.slower_side}
