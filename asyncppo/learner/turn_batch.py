"""The multi-turn part of a training batch: which response tokens the model wrote, and where turn rewards sit.

Why: a multi-turn episode is one token sequence whose environment tokens (tool output, replies) were appended as
ids, not sampled (:mod:`asyncppo.stream.turns`). The model must still *read* them (they stay in ``input_ids`` and
``attention_mask``), but no loss term may cover them: log-probs, ratios, entropy, KL, values and advantages are
all masked by ``response_mask``, so collating environment tokens to 0 there is the whole of "train on model tokens
only", with every loss normalised by the global count of model tokens. Turn rewards land on the last model token
of their turn (``TrainBatch.turn_rewards``); see :func:`asyncppo.algo.advantages.place_turn_rewards`.
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np

from asyncppo.stream.records import TrajectoryGroup
from asyncppo.stream.turns import model_token_mask, turn_reward_positions


def turn_arrays(groups: list[TrajectoryGroup]) -> tuple[Optional[np.ndarray], Optional[tuple]]:
    """``(model mask, turn rewards)`` over all response tokens of ``groups`` concatenated in order: a bool
    ``[sum T]`` array, False on environment tokens, and ``(global token index, reward)`` arrays of every turn
    reward. Both None for a batch of single-turn groups (the common case costs one check per group)."""
    turns = [g.turn_columns() for g in groups]
    if all(t is None for t in turns):
        return None, None
    masks, positions, values, base = [], [], [], 0
    for g, t in zip(groups, turns):
        offsets = list(itertools.accumulate(g.sample_lengths(), initial=0))
        masks.append(model_token_mask(t, offsets))
        if t is not None and t.turn_rewards.shape[0]:
            positions.append(turn_reward_positions(t, offsets) + base)
            values.append(np.asarray(t.turn_rewards, dtype=np.float64))
        base += offsets[-1]
    rewards = (np.concatenate(positions), np.concatenate(values)) if positions else None
    return np.concatenate(masks), rewards
