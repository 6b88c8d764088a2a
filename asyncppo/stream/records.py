"""The trajectory record: the one type that rollout workers, the stream, the buffer and the learner share.

A :class:`TrajectoryGroup` is the unit that travels: the ``num_return_sequences_in_group`` samples of one prompt,
kept together because group-relative advantages (GRPO, RLOO) need all of them. Token data are numpy arrays so that
the wire format can ship them as raw bytes (see :mod:`asyncppo.stream.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sample:
    """One generated response to a prompt."""

    response_ids: np.ndarray  # int32 [T]
    behavior_logprobs: np.ndarray  # float32 [T], log-probs of the sampled tokens at the sampling temperature
    reward: float
    finish_reason: str  # "stop" | "length"
    version_min: int  # oldest policy version whose weights produced any token of this sample
    version_max: int  # newest such version
    reward_failed: bool = False  # the reward function raised; reward is then the failure score (0.0)

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])


@dataclass
class TrajectoryGroup:
    """All samples for one prompt, plus where and when they were made."""

    group_id: str  # unique over the run: f"{worker_id}-{seq}"
    worker_id: int
    prompt_ids: np.ndarray  # int32 [P]
    samples: list[Sample]
    prompt_index: int = -1  # index of the prompt in the dataset (for debugging / eval)
    ticket: int = -1  # admission ticket that allowed this generation (-1: not admission-controlled)
    answer: str = ""  # reference answer, for logging
    timings: dict[str, float] = field(default_factory=dict)  # gen_s, reward_s, created_at (unix time)

    @property
    def version_min(self) -> int:
        return min(s.version_min for s in self.samples)

    @property
    def version_max(self) -> int:
        return max(s.version_max for s in self.samples)

    @property
    def num_response_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)
