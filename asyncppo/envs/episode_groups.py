"""A finished group of episodes as the stream record: the trajectory form of docs/environments.md.

Why a builder of its own: a single-turn sample is scored by the reward function over its decoded text, while an
episode's rewards came from its environment turn by turn (envs/episodes.py). Everything else (versions as
spans, timings from the engine meter, the record's identity) is the single-turn builder's, inherited unchanged.
"""

from __future__ import annotations

from typing import Any

from asyncppo.envs.episodes import EpisodeCompletion
from asyncppo.rollout.groups import GroupBuilder, InFlight


class EpisodeGroupBuilder(GroupBuilder):
    """Builds a :class:`~asyncppo.stream.records.TrajectoryGroup` from an
    :class:`~asyncppo.envs.episodes.EpisodeGroup`: the sample's reward is the sum of its turn rewards,
    ``env_runs`` marks the environment's tokens (None when the episode had one turn) and ``turn_rewards`` holds
    one reward per model turn."""

    def __init__(self, engine: Any, worker_id: int, stats: dict):
        super().__init__(engine, None, worker_id, stats)

    def _reward(self, c: EpisodeCompletion, flight: InFlight) -> tuple[float, bool, Any]:
        return c.reward, False, None

    def _turn_fields(self, c: EpisodeCompletion) -> dict:
        return {"env_runs": c.env_runs if c.env_runs.shape[0] else None, "turn_rewards": c.turn_rewards}
