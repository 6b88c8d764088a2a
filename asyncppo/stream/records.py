"""The trajectory record: the one type that rollout workers, the stream, the buffer and the learner share.

A :class:`TrajectoryGroup` is the unit that travels: the ``num_return_sequences_in_group`` samples of one prompt,
kept together because group-relative advantages (GRPO, RLOO) need all of them. Token data are numpy arrays so that
the wire format can ship them as raw bytes (see :mod:`asyncppo.stream.wire`).

Why a group can be *columnar*
-----------------------------
A group decoded from the wire arrives as columns: one concatenated response-id array, one concatenated log-prob
array, per-sample offsets and short scalar lists. Building eight :class:`Sample` objects and sixteen array slices
per message cost as much Python time as everything else in the receive path together, and the stream's
throughput on a small machine is bounded by exactly that time. So :meth:`TrajectoryGroup.from_columns` keeps the
columns and ``group.samples`` builds the ``Sample`` objects on first access (once; after that the list is the
truth, so code that edits a sample sees its edit everywhere). Group-level summaries that the buffer needs on every
message (``num_samples``, ``version_min``, ``version_max``, ``num_response_tokens``) are answered from the columns
without materialising anything, and so are the per-sample scalar columns (``sample_lengths``, ``sample_rewards``,
...). :meth:`TrajectoryGroup.as_columns` hands the learner's batch builder the column store itself (or columns
built from the samples of a group made on the rollout side): the trajectory stays columnar from the wire to the
loss, and the per-token versions expand straight into the batch (:meth:`SampleColumns.token_versions`).

Per-token policy versions
-------------------------
Rollout engines may swap weights in the middle of a generation, so the tokens of one sample can come from several
policy versions. Because weights only move forward, a sample's per-token versions are non-decreasing and are kept
in run-length form: ``Sample.version_spans`` is an int64 ``[S, 2]`` array of ``(start_token_index, version)`` rows,
one per version used. :func:`check_spans` states the rules (the wire format enforces them on both ends);
``None`` is the compact spelling of the common case "one version for the whole sample" (``version_min ==
version_max``). :meth:`Sample.token_versions` expands the spans, :func:`spans_from_token_versions` compresses a
per-token array, and :meth:`TrajectoryGroup.token_lag_sum` computes token-weighted policy lag from the spans
without expanding them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from asyncppo.stream.routing import RoutingColumn
from asyncppo.stream.turns import TurnColumns, turns_from_samples


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
    # int64 [S, 2] rows (start_token_index, version), see check_spans; None: every token has version_min (only
    # valid when version_min == version_max)
    version_spans: Optional[np.ndarray] = None
    # Multi-turn episodes (asyncppo.stream.turns): int64 [E, 2] rows (start, length) of the environment segments
    # of the response (None: every token is the model's), and float64 [K] rewards, one per model turn (None: one
    # outcome reward); then ``reward`` is their sum.
    env_runs: Optional[np.ndarray] = None
    turn_rewards: Optional[np.ndarray] = None

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    def token_versions(self) -> np.ndarray:
        """int64 ``[T]``: the policy version of every response token (expanded from ``version_spans``; all
        ``version_min`` when it is None). Assumes valid spans (see :func:`check_spans`)."""
        T = self.num_tokens
        spans = self.version_spans
        if spans is None:
            return np.full(T, self.version_min, dtype=np.int64)
        spans = np.asarray(spans, dtype=np.int64)
        if T == 0:
            return np.zeros(0, dtype=np.int64)
        return np.repeat(spans[:, 1], np.diff(spans[:, 0], append=T))

    def spans(self) -> np.ndarray:
        """``version_spans`` as an int64 ``[S, 2]`` array, with None spelled out as ``[(0, version_min)]``."""
        if self.version_spans is None:
            return np.array([[0, self.version_min]], dtype=np.int64)
        return np.asarray(self.version_spans, dtype=np.int64)


def spans_from_token_versions(versions: np.ndarray, default_version: Optional[int] = None) -> np.ndarray:
    """The compact ``[S, 2]`` int64 form (rows ``(start_token_index, version)``) of a non-decreasing per-token
    version array. For an empty array the version cannot be read off the tokens: ``default_version`` is used
    (``[(0, default_version)]``), and ValueError is raised when it is None. ValueError too if ``versions`` is not
    1-D or decreases anywhere (weights never go back)."""
    v = np.asarray(versions)
    if v.ndim != 1:
        raise ValueError(f"spans_from_token_versions: expected a 1-D array, got shape {v.shape}")
    if v.shape[0] == 0:
        if default_version is None:
            raise ValueError("spans_from_token_versions: empty array and no default_version")
        return np.array([[0, int(default_version)]], dtype=np.int64)
    if v.dtype.kind not in "iu":
        raise ValueError(f"spans_from_token_versions: versions must be integers, got dtype {v.dtype}")
    v = v.astype(np.int64, copy=False)
    step = np.diff(v)
    if step.size and step.min() < 0:
        t = int(np.argmax(step < 0)) + 1
        raise ValueError(f"spans_from_token_versions: version decreases at token {t} ({v[t - 1]} -> {v[t]})")
    starts = np.flatnonzero(step) + 1
    starts = np.concatenate(([0], starts)).astype(np.int64)
    return np.stack((starts, v[starts]), axis=1)


def check_spans(spans: Any, num_tokens: int, version_min: int, version_max: int) -> Optional[str]:
    """What is wrong with ``spans`` for a sample of ``num_tokens`` tokens, or None when they are valid.

    The rules: an integer ``[S, 2]`` array with ``1 <= S <= max(num_tokens, 1)``; starts strictly increasing,
    the first 0, all ``< num_tokens`` when ``num_tokens > 0``; versions ``>= 0`` and strictly increasing; the first
    version is ``version_min`` and the last ``version_max``. (This is the one-sample statement of the rules the wire
    format checks vectorised over a whole group.)"""
    if not isinstance(spans, np.ndarray) or spans.ndim != 2 or spans.shape[1] != 2 or spans.dtype.kind not in "iu":
        what = (f"dtype {spans.dtype}, shape {spans.shape}" if isinstance(spans, np.ndarray)
                else type(spans).__name__)
        return f"must be an integer numpy array of shape [S, 2], got {what}"
    S = spans.shape[0]
    if S < 1 or S > max(num_tokens, 1):
        return f"has {S} spans; a sample of {num_tokens} tokens needs 1..{max(num_tokens, 1)}"
    starts, vers = spans[:, 0].tolist(), spans[:, 1].tolist()
    if starts[0] != 0:
        return f"first start is {starts[0]}, must be 0"
    if any(b <= a for a, b in zip(starts, starts[1:])):
        return f"starts {starts} are not strictly increasing"
    if num_tokens > 0 and starts[-1] >= num_tokens:
        return f"start {starts[-1]} is not < num_tokens={num_tokens}"
    if min(vers) < 0:
        return f"versions {vers} must be >= 0"
    if any(b <= a for a, b in zip(vers, vers[1:])):
        return f"versions {vers} are not strictly increasing"
    if vers[0] != version_min:
        return f"first version {vers[0]} != version_min={version_min}"
    if vers[-1] != version_max:
        return f"last version {vers[-1]} != version_max={version_max}"
    return None


class SampleColumns(NamedTuple):
    """The samples of one group stored column-wise. Sample ``j`` owns ``[offsets[j], offsets[j+1])`` of the two
    concatenated token arrays and rows ``[span_offsets[j], span_offsets[j+1])`` of ``version_spans`` (every sample
    has at least one span, even one whose ``Sample.version_spans`` was None); the scalar columns are plain lists
    (or tuples) of length ``n``."""

    response_ids: np.ndarray  # [sum T] concatenated
    behavior_logprobs: np.ndarray  # [sum T] concatenated
    offsets: list[int]  # n + 1 entries, offsets[0] == 0
    reward: list[float]
    finish_reason: list[str]
    version_min: list[int]
    version_max: list[int]
    reward_failed: list[bool]
    version_spans: np.ndarray  # int64 [sum S, 2] concatenated (start_token_index, version) rows
    span_offsets: list[int]  # n + 1 entries, span_offsets[0] == 0
    turns: Optional[TurnColumns] = None  # environment segments and turn rewards; None for single-turn groups

    @classmethod
    def from_samples(cls, samples: list[Sample]) -> "SampleColumns":
        """The columns of ``samples`` (copies of their arrays, concatenated): how a group built from Sample
        objects on the rollout side joins the columnar path. Token arrays keep the samples' dtypes."""
        lengths = [s.num_tokens for s in samples]
        spans = [s.spans() for s in samples]
        return cls(
            np.concatenate([np.asarray(s.response_ids) for s in samples]) if samples else np.zeros(0, np.int64),
            np.concatenate([np.asarray(s.behavior_logprobs) for s in samples]) if samples
            else np.zeros(0, np.float32),
            list(itertools.accumulate(lengths, initial=0)),
            [s.reward for s in samples],
            [s.finish_reason for s in samples],
            [s.version_min for s in samples],
            [s.version_max for s in samples],
            [s.reward_failed for s in samples],
            np.concatenate(spans) if spans else np.zeros((0, 2), np.int64),
            list(itertools.accumulate((sp.shape[0] for sp in spans), initial=0)),
            turns_from_samples(samples),
        )

    def lengths(self) -> list[int]:
        """Response length of every sample."""
        off = self.offsets
        return [b - a for a, b in zip(off, off[1:])]

    def span_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``(version of each span, number of tokens it covers)``, both int64 ``[sum S]``, over all samples (one
        vectorised pass; assumes valid spans, which the wire format guarantees)."""
        total = self.offsets[-1]
        spans = np.asarray(self.version_spans, dtype=np.int64)
        if total == 0 or spans.shape[0] == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        counts = np.diff(np.asarray(self.span_offsets, dtype=np.int64))
        # global token index where each span begins: its sample's token offset plus its start. The first start of
        # every sample is 0, so these are non-decreasing and each span ends where the next one begins.
        gstart = spans[:, 0] + np.repeat(np.asarray(self.offsets[:-1], dtype=np.int64), counts)
        return spans[:, 1], np.diff(gstart, append=total)

    def token_versions(self) -> np.ndarray:
        """int64 ``[sum T]``: the policy version of every response token, all samples concatenated."""
        versions, covered = self.span_tokens()
        if versions.shape[0] == 0:
            return np.zeros(self.offsets[-1], dtype=np.int64)
        return np.repeat(versions, covered)

    def materialise(self) -> list[Sample]:
        ids, lps, off = self.response_ids, self.behavior_logprobs, self.offsets
        spans, soff = self.version_spans, self.span_offsets
        samples = [
            Sample(ids[a:b], lps[a:b], r, f, v0, v1, bad, spans[c:d])
            for a, b, r, f, v0, v1, bad, c, d in zip(
                off, off[1:], self.reward, self.finish_reason, self.version_min, self.version_max, self.reward_failed,
                soff, soff[1:],
            )
        ]
        if self.turns is not None:
            for j, s in enumerate(samples):
                runs, rewards = self.turns.sample(j)
                s.env_runs = runs if runs.shape[0] else None
                s.turn_rewards = rewards if rewards.shape[0] else None
        return samples


class TrajectoryGroup:
    """All samples for one prompt, plus where and when they were made.

    Construct it with a list of :class:`Sample` (rollout workers, tests) or, on the receiving side, with
    :meth:`from_columns`; both behave the same to every reader."""

    __slots__ = ("group_id", "worker_id", "prompt_ids", "prompt_index", "ticket", "answer", "timings",
                 "_samples", "_columns", "routing")

    def __init__(
        self,
        group_id: str,  # unique over the run: f"{worker_id}-{seq}"
        worker_id: int,
        prompt_ids: np.ndarray,  # int32 [P]
        samples: Optional[list[Sample]] = None,
        prompt_index: int = -1,  # index of the prompt in the dataset (for debugging / eval)
        ticket: int = -1,  # admission ticket that allowed this generation (-1: not admission-controlled)
        answer: str = "",  # reference answer, for logging
        timings: Optional[dict[str, float]] = None,  # gen_s, reward_s, created_at (unix time)
        routing: Optional[RoutingColumn] = None,  # MoE policies: the engine's experts per position (stream/routing.py)
    ):
        self.group_id = group_id
        self.worker_id = worker_id
        self.prompt_ids = prompt_ids
        self._samples: Optional[list[Sample]] = [] if samples is None else samples
        self._columns: Optional[SampleColumns] = None
        self.prompt_index = prompt_index
        self.ticket = ticket
        self.answer = answer
        self.timings = {} if timings is None else timings
        self.routing = routing

    @classmethod
    def from_columns(cls, group_id: str, worker_id: int, prompt_ids: np.ndarray, columns: SampleColumns,
                     prompt_index: int = -1, ticket: int = -1, answer: str = "",
                     timings: Optional[dict[str, float]] = None,
                     routing: Optional[RoutingColumn] = None) -> "TrajectoryGroup":
        """A group whose ``Sample`` objects are built lazily from ``columns`` (see the module docstring)."""
        g = cls(group_id, worker_id, prompt_ids, None, prompt_index, ticket, answer, timings, routing)
        g._samples = None
        g._columns = columns
        return g

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = self._columns.materialise()
            self._columns = None
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        self._samples = value
        self._columns = None

    @property
    def columns(self) -> Optional[SampleColumns]:
        """The column store while no ``Sample`` has been materialised, else None (the samples are the truth)."""
        return self._columns

    def as_columns(self) -> SampleColumns:
        """The samples column-wise: the column store itself while the group is columnar (no copy), else columns
        built from the Sample objects. What the learner's batch is built from (:mod:`asyncppo.learner.batch`)."""
        c = self._columns
        return c if c is not None else SampleColumns.from_samples(self._samples)

    def turn_columns(self) -> Optional[TurnColumns]:
        """The environment segments and turn rewards of a multi-turn group (:mod:`asyncppo.stream.turns`), None
        for a single-turn group; no column store is built for a group made of Sample objects. ValueError when a
        sample's turn arrays have the wrong type."""
        c = self._columns
        return c.turns if c is not None else turns_from_samples(self._samples)

    def sample_lengths(self) -> list[int]:
        """Response length of every sample (from the columns without materialising samples)."""
        c = self._columns
        return c.lengths() if c is not None else [s.num_tokens for s in self._samples]

    def _per_sample(self, field: str) -> list:
        """One scalar field of every sample: a column of the store, or read off the Sample objects (both name
        their fields alike)."""
        c = self._columns
        return list(getattr(c, field)) if c is not None else [getattr(s, field) for s in self._samples]

    def sample_rewards(self) -> list[float]:
        return self._per_sample("reward")

    def sample_reward_failed(self) -> list[bool]:
        return self._per_sample("reward_failed")

    def sample_version_mins(self) -> list[int]:
        return self._per_sample("version_min")

    def sample_version_maxs(self) -> list[int]:
        return self._per_sample("version_max")

    @property
    def num_samples(self) -> int:
        c = self._columns
        return len(c.reward) if c is not None else len(self._samples)

    @property
    def version_min(self) -> int:
        c = self._columns
        return min(c.version_min) if c is not None else min(s.version_min for s in self._samples)

    @property
    def version_max(self) -> int:
        c = self._columns
        return max(c.version_max) if c is not None else max(s.version_max for s in self._samples)

    @property
    def num_response_tokens(self) -> int:
        c = self._columns
        return c.offsets[-1] if c is not None else sum(s.num_tokens for s in self._samples)

    def token_lag_sum(self, learner_version: int) -> tuple[int, int]:
        """``(sum over all response tokens of learner_version - token_version, number of response tokens)``.

        Computed from the version spans without expanding them per token (one vectorised pass over the columns
        while the group is columnar). Divide the two for the token-weighted mean policy lag."""
        c = self._columns
        if c is not None:
            versions, covered = c.span_tokens()
            if versions.shape[0] == 0:
                return 0, c.offsets[-1]
            return learner_version * c.offsets[-1] - int(np.dot(versions, covered)), c.offsets[-1]
        lag = tokens = 0
        for s in self._samples:
            T = s.num_tokens
            tokens += T
            if s.version_spans is None:
                lag += (learner_version - s.version_min) * T
            elif T:
                sp = np.asarray(s.version_spans, dtype=np.int64)
                lag += learner_version * T - int(np.dot(sp[:, 1], np.diff(sp[:, 0], append=T)))
        return lag, tokens

    def __repr__(self) -> str:
        return (f"TrajectoryGroup(group_id={self.group_id!r}, worker_id={self.worker_id}, "
                f"n={self.num_samples}, prompt_len={len(self.prompt_ids)}, ticket={self.ticket})")
