"""Multi-turn episodes: which response tokens the environment wrote, and the rewards of each turn.

Why a separate column
---------------------
A multi-turn episode is ONE token sequence: the prompt, then model tokens (sampled by the engine, with a behaviour
log-prob and a policy version) alternating with environment tokens (tool output, a user reply) that were appended
as ids and never sampled. The learner must train on model tokens only, so every response token needs a loss mask.
A per-token mask would add a byte (or a bit) per token to every frame; an episode has a handful of environment
segments, so the mask travels as **run-lengths of environment segments**: rows ``(start, length)`` in response
token coordinates, one per environment segment. A single-turn sample has no rows, and a group with no environment
tokens and no turn rewards carries no turn data at all (``SampleColumns.turns is None``): its frame is byte-for-byte
the single-turn frame of before.

The rules (:func:`check_turns`; the decoder and the learner's door both apply them)
------------------------------------------------------------------------------
* ``start >= 0``, and a sample with a response has at least one model token. A segment at ``start == 0`` opens the
  response before the model speaks: an agent's branch (docs/agents.md), whose rewritten conversation follows the
  prompt; it ends no model turn. Every other segment follows a model turn;
* ``length >= 1`` and ``start + length <= T`` (the sample's response length);
* segments are ordered with at least one model token between two of them (adjacent segments would be one);
* ``turn_rewards`` has either 0 entries or one per *model turn* (maximal run of model tokens).

Conventions
-----------
* Environment tokens have behaviour log-prob exactly 0 and carry the policy version of the model token before them
  (so no version span may start inside an environment segment, except the sample's first span on an opening
  segment, whose tokens carry a version no later than the model's first; the door checks both). Versions are therefore
  non-decreasing over the whole episode, and the per-token staleness bound covers environment tokens for free.
* Turn ``k``'s reward belongs to the **last model token of turn k**. When a sample carries turn rewards, its scalar
  ``reward`` must equal their sum (the door checks it): the outcome-reward estimators (GRPO, RLOO, ...) read that
  sum, and estimators that see token positions (GAE, REINFORCE return-to-go) see each reward where its turn ended.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Sequence

import numpy as np

_I8 = np.dtype("<i8")
_F8 = np.dtype("<f8")


class TurnColumns(NamedTuple):
    """The turn data of a group's samples, column-wise. Sample ``j`` owns rows ``[run_offsets[j],
    run_offsets[j+1])`` of ``env_runs`` and entries ``[reward_offsets[j], reward_offsets[j+1])`` of
    ``turn_rewards``."""

    env_runs: np.ndarray  # int64 [E, 2] rows (start, length) in response-token coordinates, all samples
    run_offsets: list  # n + 1 entries
    turn_rewards: np.ndarray  # float64 [K], all samples
    reward_offsets: list  # n + 1 entries

    def run_counts(self) -> list:
        return [b - a for a, b in zip(self.run_offsets, self.run_offsets[1:])]

    def reward_counts(self) -> list:
        return [b - a for a, b in zip(self.reward_offsets, self.reward_offsets[1:])]

    def sample(self, j: int) -> tuple:
        """``(env_runs, turn_rewards)`` of sample ``j`` (views)."""
        ro, wo = self.run_offsets, self.reward_offsets
        return self.env_runs[ro[j]:ro[j + 1]], self.turn_rewards[wo[j]:wo[j + 1]]


def _as_runs(runs, j: int) -> np.ndarray:
    if runs is None:
        return np.zeros((0, 2), _I8)
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 2 or runs.dtype.kind not in "iu":
        what = f"dtype {runs.dtype}, shape {runs.shape}" if isinstance(runs, np.ndarray) else type(runs).__name__
        raise ValueError(f"samples[{j}].env_runs must be an integer numpy array of shape [E, 2], got {what}")
    return runs.astype(_I8, copy=False)


def _as_rewards(rewards, j: int) -> np.ndarray:
    if rewards is None:
        return np.zeros(0, _F8)
    if not isinstance(rewards, np.ndarray) or rewards.ndim != 1 or rewards.dtype.kind != "f":
        what = f"dtype {rewards.dtype}, shape {rewards.shape}" if isinstance(rewards, np.ndarray) \
            else type(rewards).__name__
        raise ValueError(f"samples[{j}].turn_rewards must be a 1-D float numpy array, got {what}")
    return rewards.astype(_F8, copy=False)


def turns_from_samples(samples: Sequence) -> Optional[TurnColumns]:
    """The turn columns of ``samples`` (objects with ``env_runs`` and ``turn_rewards``), or None when no sample
    has an environment segment or a turn reward (a single-turn group). ValueError on a wrongly typed array."""
    if all(s.env_runs is None and s.turn_rewards is None for s in samples):
        return None
    runs = [_as_runs(s.env_runs, j) for j, s in enumerate(samples)]
    rewards = [_as_rewards(s.turn_rewards, j) for j, s in enumerate(samples)]
    return TurnColumns(
        np.concatenate(runs), list(itertools.accumulate((r.shape[0] for r in runs), initial=0)),
        np.concatenate(rewards), list(itertools.accumulate((r.shape[0] for r in rewards), initial=0)),
    )


def _owners(turns: TurnColumns) -> np.ndarray:
    return np.repeat(np.arange(len(turns.run_offsets) - 1), turns.run_counts())


def _closing_counts(turns: TurnColumns) -> np.ndarray:
    """Per sample, the segments that end a model turn: all but an opening one (``start == 0``)."""
    closing = turns.env_runs[:, 0] > 0
    return np.bincount(_owners(turns)[closing], minlength=len(turns.run_offsets) - 1).astype(np.int64)


def model_turn_counts(turns: TurnColumns, lengths: Sequence[int]) -> np.ndarray:
    """Number of model turns (maximal runs of model tokens) of every sample; assumes valid runs."""
    T = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(turns.run_counts(), dtype=np.int64)
    closing = _closing_counts(turns) if counts.any() else counts
    trailing = T > 0  # a sample without segments is one turn (when it has tokens at all)
    has = counts > 0
    if has.any():
        last = np.asarray(turns.run_offsets[1:], dtype=np.int64)[has] - 1
        ends = turns.env_runs[last, 0] + turns.env_runs[last, 1]
        trailing[has] = ends < T[has]
    return closing + trailing


def check_turns(turns: TurnColumns, lengths: Sequence[int]) -> Optional[str]:
    """What breaks the turn rules (module docstring) for samples of response ``lengths``, or None. A fixed number
    of numpy operations over all segments of the group, whatever their count."""
    n = len(lengths)
    runs, ro, wo = turns.env_runs, list(turns.run_offsets), list(turns.reward_offsets)
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 2 or runs.dtype.kind not in "iu":
        return "env_runs must be an integer [E, 2] array"
    rw = turns.turn_rewards
    if not isinstance(rw, np.ndarray) or rw.ndim != 1 or rw.dtype.kind != "f":
        return "turn_rewards must be a 1-D float array"
    for name, off, total in (("run_offsets", ro, runs.shape[0]), ("reward_offsets", wo, rw.shape[0])):
        if len(off) != n + 1 or off[0] != 0 or off[-1] != total or any(b < a for a, b in zip(off, off[1:])):
            return f"{name} {off} do not cover {total} rows of {n} samples"
    if runs.shape[0]:
        runs = runs.astype(_I8, copy=False)
        owner = _owners(turns)
        T = np.asarray(lengths, dtype=np.int64)[owner]
        start, length = runs[:, 0], runs[:, 1]
        # end = start + length can wrap around in int64 (a hostile (2**63 - L, L) looked in range and then sized
        # arrays by L): compare the length with the room left instead, and use end only once that holds
        past = length > T - start
        end = np.where(past, T, start + length)
        same = owner[1:] == owner[:-1]
        for bad, what in ((start < 0, "starts at token {s}, before the first response token"),
                          (length < 1, "has length {l} < 1"),
                          (past, "ends at {e} past the response of {T} tokens"),
                          (np.concatenate(([False], same & (start[1:] <= end[:-1]))),
                           "at {s} overlaps or touches the previous one (a model token must separate segments)")):
            if bad.any():
                i = int(np.argmax(bad))
                s, length_i = int(start[i]), int(length[i])
                detail = what.format(s=s, l=length_i, e=s + length_i, T=int(T[i]))
                return f"samples[{int(owner[i])}] environment segment {i - ro[int(owner[i])]} {detail}"
        env_tokens = np.bincount(owner, weights=length, minlength=n)
        empty = (env_tokens >= np.asarray(lengths, dtype=np.int64)) & (np.asarray(turns.run_counts()) > 0)
        if empty.any():
            return f"samples[{int(np.argmax(empty))}] has no model token (its environment segments cover its response)"
    want = model_turn_counts(turns, lengths)
    got = np.asarray(turns.reward_counts(), dtype=np.int64)
    bad = (got != 0) & (got != want)
    if bad.any():
        j = int(np.argmax(bad))
        return f"samples[{j}] has {int(got[j])} turn rewards for {int(want[j])} model turns (give 0 or one per turn)"
    return None


def _env_positions(turns: TurnColumns, offsets: Sequence[int]) -> np.ndarray:
    """Global (all samples concatenated) token index of every environment token; assumes valid runs."""
    runs = turns.env_runs.astype(_I8, copy=False)
    if runs.shape[0] == 0:
        return np.zeros(0, _I8)
    gstart = runs[:, 0] + np.asarray(offsets[:-1], dtype=np.int64)[_owners(turns)]
    length = runs[:, 1]
    within = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    return np.repeat(gstart, length) + within


def model_token_mask(turns: Optional[TurnColumns], offsets: Sequence[int]) -> np.ndarray:
    """bool ``[sum T]``: True on model tokens, False on environment tokens, all samples concatenated."""
    mask = np.ones(int(offsets[-1]), dtype=bool)
    if turns is not None:
        mask[_env_positions(turns, offsets)] = False
    return mask


def turn_reward_positions(turns: TurnColumns, offsets: Sequence[int]) -> np.ndarray:
    """Global token index of each entry of ``turns.turn_rewards``: the last model token of its turn (assumes the
    rules hold). Ordered like ``turn_rewards``."""
    off = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(off)
    runs = turns.env_runs.astype(_I8, copy=False)
    closing = runs[:, 0] > 0  # an opening segment ends no model turn
    owner = _owners(turns)[closing]
    before_env = off[:-1][owner] + runs[closing, 0] - 1  # the model token just before each closing segment
    counts = model_turn_counts(turns, lengths)
    n_closing = _closing_counts(turns) if runs.shape[0] else np.zeros(len(lengths), np.int64)
    trailing = np.flatnonzero(counts > n_closing)  # samples whose last turn is the model's
    ends = off[1:][trailing] - 1
    owners = np.concatenate((owner, trailing))
    positions = np.concatenate((before_env, ends))
    order = np.lexsort((positions, owners))
    positions, owners = positions[order], owners[order]
    has_rewards = np.asarray(turns.reward_counts(), dtype=np.int64) > 0
    return positions[has_rewards[owners]]


def version_starts_in_env(env_positions: np.ndarray, spans: np.ndarray, span_offsets: Sequence[int],
                          offsets: Sequence[int]) -> Optional[int]:
    """The sample index of the first version span that starts on an environment token (environment tokens carry
    the version of the model token before them), or None. ``env_positions``: the group's environment tokens as
    flat indices (:func:`_env_positions`, which the caller has already computed)."""
    spans = np.asarray(spans, dtype=np.int64)
    counts = np.diff(np.asarray(span_offsets, dtype=np.int64))
    gstart = spans[:, 0] + np.repeat(np.asarray(offsets[:-1], dtype=np.int64), counts)
    env = np.zeros(int(offsets[-1]) + 1, dtype=bool)
    env[env_positions] = True
    hit = env[gstart] & (spans[:, 0] > 0)  # a sample's first span may open on its opening segment
    if not hit.any():
        return None
    return int(np.repeat(np.arange(counts.shape[0]), counts)[int(np.argmax(hit))])


#: Relative tolerance of ``reward == sum(turn_rewards)`` (the sender sums in float64; anything further off is a
#: sender that trains on one reward and reports another).
REWARD_SUM_RTOL = 1e-6


def turn_content_problem(columns, structure_checked: bool = False) -> Optional[tuple]:
    """``(reason, detail)`` of the first turn rule a group's columns (:class:`SampleColumns`) break, or None: the
    structural rules (skipped when ``structure_checked``: the wire decoder proved them for the columns it built),
    environment log-probs exactly 0, no version span starting on an environment token, finite turn rewards summing
    to the sample's reward. ``reason`` is ``"turns"`` or ``"nonfinite"`` (the learner's door counts it)."""
    turns, lengths, offsets = columns.turns, columns.lengths(), columns.offsets
    problem = None if structure_checked else check_turns(turns, lengths)
    if problem is not None:
        return "turns", problem
    env = _env_positions(turns, offsets)
    if env.shape[0]:
        lps = np.asarray(columns.behavior_logprobs)[env]
        if np.count_nonzero(lps):
            return "turns", f"{np.count_nonzero(lps)} environment token(s) have a non-zero behaviour log-prob"
    j = version_starts_in_env(env, columns.version_spans, columns.span_offsets, offsets)
    if j is not None:
        return "turns", (f"samples[{j}]: a version span starts on an environment token (environment tokens keep "
                         f"the version of the model token before them)")
    rewards = np.asarray(turns.turn_rewards, dtype=np.float64)
    if not np.isfinite(rewards).all():
        return "nonfinite", "a turn reward is NaN or infinite"
    counts = turns.reward_counts()
    has = np.asarray(counts) > 0
    if has.any():
        sums = np.add.reduceat(rewards, np.asarray(turns.reward_offsets[:-1])[has])
        told = np.asarray(columns.reward, dtype=np.float64)[has]
        off = np.abs(sums - told) > REWARD_SUM_RTOL * np.maximum(1.0, np.abs(told))
        if off.any():
            j = int(np.flatnonzero(has)[int(np.argmax(off))])
            return "turns", f"samples[{j}]: reward {told[int(np.argmax(off))]} != sum of its turn rewards"
    return None
