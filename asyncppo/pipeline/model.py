"""The pipeline simulator's inputs and outputs: engine and learner speeds, the configuration, and the result.

Kept apart from the event loop (:mod:`asyncppo.pipeline.simulator`) so that a reader sees what the model takes and
gives in one place, and so that rates and workloads can be built without the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from asyncppo.config.choices import ADMISSION_UNITS


@dataclass(frozen=True)
class EngineSpeed:
    """Seconds per decode step of one engine: ``base_s + per_seq_s * running + per_kv_token_s * context_tokens``."""

    base_s: float
    per_seq_s: float = 0.0
    per_kv_token_s: float = 0.0
    max_num_seqs: int = 256

    def tokens_per_s(self, running: int, context: float = 0.0) -> float:
        return running / (self.base_s + self.per_seq_s * running + self.per_kv_token_s * context * running)


@dataclass(frozen=True)
class TrainSpeed:
    """Seconds per learner step: ``base_s + per_token_s * response_tokens / (ranks * efficiency)``."""

    base_s: float
    per_token_s: float
    efficiency: float = 1.0

    def step_s(self, tokens: float, ranks: int) -> float:
        return self.base_s + self.per_token_s * tokens / (max(1, ranks) * self.efficiency)


@dataclass(frozen=True)
class Setup:
    engines: int
    train_ranks: int
    batch_groups: int  # B = rollout.rollout_batch_size
    group_size: int  # n = rollout.num_return_sequences_in_group
    max_staleness: int  # k
    sync_every: int = 1
    load_s: float = 0.0  # engine pause per weight load (broadcast + load)
    prompt_tokens: int = 0  # context each sequence starts with (only the per-KV term reads it)
    steps: int = 40
    warmup_steps: int = 8
    seed: int = 0
    colocated: bool = False
    switch_s: float = 0.0
    admission_unit: str = "group"  # group | slot, as rollout.admission_unit (config/choices.py: admission_room)
    lookahead: Optional[int] = None  # j = rollout.admission_lookahead (None: k, ticket order without deferral)
    # multi-turn episodes (env.text_env): model turns per episode (a mean: each episode draws the integer below or
    # above it), seconds of the environment call after every model turn, and the share of a sample's response
    # tokens the engine decodes (the environment wrote the rest); turns = 1 and env_s = 0: single-turn samples
    turns: float = 1.0
    env_s: float = 0.0
    model_frac: float = 1.0

    @property
    def episodes(self) -> bool:
        """Samples that leave the engine for an environment call (the episode worker's admission rule applies)."""
        return self.turns > 1.0 or self.env_s > 0.0

    def __post_init__(self) -> None:
        if self.engines < 1 or self.train_ranks < 1 or self.batch_groups < 1 or self.group_size < 1:
            raise ValueError(f"engines, train_ranks, batch_groups and group_size must be >= 1: {self}")
        if self.max_staleness < 0 or self.sync_every < 1:
            raise ValueError("max_staleness must be >= 0 and sync_every >= 1")
        if self.max_staleness < self.sync_every - 1:
            raise ValueError("max_staleness must be >= sync_every - 1 (as rollout.sync_every requires)")
        if self.colocated and self.max_staleness != 0:
            raise ValueError("a colocated pool alternates: it needs max_staleness = 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError("need 0 <= warmup_steps < steps")
        if self.lookahead is not None and not 0 <= self.lookahead <= self.max_staleness:
            raise ValueError(f"lookahead must be in [0, max_staleness={self.max_staleness}], got {self.lookahead}")
        if self.lookahead is not None and self.lookahead < self.sync_every - 1:
            raise ValueError(f"lookahead must be >= sync_every - 1 = {self.sync_every - 1} (as "
                             "rollout.admission_lookahead requires: the engines would never get the weights a "
                             "ticket needs, and the pipeline would stall)")
        if not (1.0 <= self.turns < math.inf and 0.0 <= self.env_s < math.inf and 0.0 < self.model_frac <= 1.0):
            raise ValueError(f"need turns >= 1, env_s >= 0 and 0 < model_frac <= 1: turns={self.turns}, "
                             f"env_s={self.env_s}, model_frac={self.model_frac}")
        if self.admission_unit not in ADMISSION_UNITS:
            raise ValueError(f"admission_unit must be one of {ADMISSION_UNITS}, got {self.admission_unit!r}")


@dataclass
class Result:
    samples_per_s: float
    tokens_per_s: float  # decoded tokens (an episode's environment tokens are not decoded)
    step_s: float  # mean learner step period in the measured window
    rollout_busy: float  # engine time spent decoding / (engines * wall)
    train_busy: float  # learner time spent training / wall
    occupancy: float  # running sequences / max_num_seqs, averaged over decode steps
    lag_mean: float
    lag_max: int
    token_lag_mean: float
    waste: float  # generated tokens never trained / generated: 0 under admission control (kept for the table)
    idle_gpu_frac: float  # 1 - busy GPU-seconds / all GPU-seconds (how much of the budget waits)
    step_times: list[float] = field(default_factory=list)
