"""Response-length models for the pipeline simulator: where the long tail that decides everything comes from.

A group finishes with its longest sample, and lengths inside a group are correlated (the same prompt), so the
models draw whole groups, not independent samples:

* :class:`FixedLengths` - every sample has the same length (the hand-solvable cases in the tests);
* :class:`EmpiricalGroups` - replays groups measured in a run (``summary.json: rollout.group_lengths``);
* :class:`LogNormalLengths` - a lognormal given its mean and p99 (how papers describe reasoning workloads), capped
  at the response budget, with a per-prompt factor that makes samples of one group alike.

Pure Python: no numpy needed, so the simulator stays importable anywhere.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

_Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass(frozen=True)
class FixedLengths:
    length: int

    def sample_group(self, rng: random.Random, n: int) -> list[int]:
        return [self.length] * n

    @property
    def mean(self) -> float:
        return float(self.length)


@dataclass(frozen=True)
class EmpiricalGroups:
    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.groups or any(not g for g in self.groups):
            raise ValueError("EmpiricalGroups needs at least one non-empty group of lengths")

    def sample_group(self, rng: random.Random, n: int) -> list[int]:
        g = self.groups[rng.randrange(len(self.groups))]
        # a group of another size: draw its samples from the chosen group's lengths (keeps the correlation)
        return list(g) if len(g) == n else [g[rng.randrange(len(g))] for _ in range(n)]

    @property
    def mean(self) -> float:
        return sum(sum(g) for g in self.groups) / sum(len(g) for g in self.groups)


@dataclass(frozen=True)
class LogNormalLengths:
    """Lognormal response lengths with the given mean and 99th percentile, clipped to ``[1, cap]``.

    ``within_group`` in [0, 1] is the share of the log-variance that is per prompt (shared by the group's samples);
    0 makes samples independent, 1 makes every sample of a group equal."""

    mean_tokens: float
    p99_tokens: float
    cap: int
    within_group: float = 0.5

    def __post_init__(self) -> None:
        if not (0 < self.mean_tokens < self.p99_tokens):
            raise ValueError(f"need 0 < mean ({self.mean_tokens}) < p99 ({self.p99_tokens})")
        if not 0.0 <= self.within_group <= 1.0:
            raise ValueError("within_group must be in [0, 1]")

    @property
    def sigma(self) -> float:
        # log p99 - log mean = z*s - s^2/2  ->  s = z - sqrt(z^2 - 2*log(p99/mean)) (the smaller root)
        d = math.log(self.p99_tokens / self.mean_tokens)
        disc = _Z99 * _Z99 - 2.0 * d
        if disc < 0:
            raise ValueError(f"no lognormal has mean {self.mean_tokens} and p99 {self.p99_tokens} (tail too heavy)")
        return _Z99 - math.sqrt(disc)

    @property
    def mu(self) -> float:
        return math.log(self.mean_tokens) - self.sigma ** 2 / 2.0

    def sample_group(self, rng: random.Random, n: int) -> list[int]:
        s, mu = self.sigma, self.mu
        shared = rng.gauss(0.0, s * math.sqrt(self.within_group))
        own = s * math.sqrt(1.0 - self.within_group)
        return [max(1, min(self.cap, int(round(math.exp(mu + shared + rng.gauss(0.0, own)))))) for _ in range(n)]

    @property
    def mean(self) -> float:
        return self.mean_tokens


def capped(lengths, cap: int):
    """The same model with every length clipped to ``cap`` (a smaller ``rollout.response_length``)."""
    if isinstance(lengths, FixedLengths):
        return FixedLengths(min(lengths.length, cap))
    if isinstance(lengths, EmpiricalGroups):
        return EmpiricalGroups(tuple(tuple(min(x, cap) for x in g) for g in lengths.groups))
    if isinstance(lengths, LogNormalLengths):
        return LogNormalLengths(lengths.mean_tokens, lengths.p99_tokens, min(cap, lengths.cap), lengths.within_group)
    raise TypeError(f"unknown length model {type(lengths).__name__}")


def parse_groups(rows: Sequence[str]) -> EmpiricalGroups:
    """``summary.json``'s ``rollout.group_lengths`` (one ``"3 4 3 3"`` string per group) -> a model."""
    return EmpiricalGroups(tuple(tuple(int(x) for x in r.split()) for r in rows if r.strip()))
