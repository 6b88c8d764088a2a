"""Admission's count of an engine's load when episodes leave it for their environments.

Shared by the episode worker (:mod:`asyncppo.envs.episode_worker`), which admits groups by it, and the advisor's
simulator (:mod:`asyncppo.report.simulator`), which replays the same rule on simulated time, so that the two count
room alike.
"""

from __future__ import annotations

import math
import time


def engine_load(running: int, in_flight: int, share: float) -> int:
    """What admission counts as the engine's load (:class:`EngineShare`): the sequences in it now, or the episodes
    in flight times their share of time in the engine, whichever is larger (an engine that is full now is full)."""
    return max(running, math.ceil(in_flight * share - 1e-9))


class EngineShare:
    """The share of an episode's time in flight that it spends in the engine (decoding or queued for it), as a
    moving average over ``horizon_s`` seconds of time-weighted counts; 1.0 until anything was seen.

    Why admission needs it. A single-turn group holds its engine slots for its whole life, so "room" is
    ``max_num_seqs`` minus the sequences in the engine. An episode leaves the engine at every environment call: by
    Little's law the engine's load is ``episodes in flight x share``, while the count *this instant* swings with
    the turns. With a slow tool the episodes move in waves (a wave's turns end together and it leaves for the tool
    together): counted instantly, a wave in the engine reads as a full engine and no group is admitted, and the
    wave at its tool reads as room for at most one engine-full of groups, which then decode in step with it. So
    the episodes in flight stay near ``max_num_seqs`` however slow the tool is, and the engine empties whenever
    they all wait (``episodes/env_wait_s``). Counting the expected load instead admits
    ``max_num_seqs / share`` episodes (the staleness window still bounds them): enough that some are always
    decoding while the others wait. With a fast tool the share is ~1 and admission is what it was."""

    horizon_s = 2.0

    def __init__(self) -> None:
        self._engine = self._env = 0.0
        self._last: float | None = None
        self._counts = (0, 0)

    def add(self, in_engine: int, at_env: int, now: float | None = None) -> None:
        """The counts now (``now``: a ``time.perf_counter()`` reading); the previous counts held since the previous
        call."""
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            keep = math.exp(-(now - self._last) / self.horizon_s)
            self._engine = keep * self._engine + (1 - keep) * self._counts[0]
            self._env = keep * self._env + (1 - keep) * self._counts[1]
        self._last, self._counts = now, (in_engine, at_env)

    @property
    def share(self) -> float:
        total = self._engine + self._env
        return self._engine / total if total > 0 else 1.0
