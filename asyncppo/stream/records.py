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
without materialising anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

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


class SampleColumns(NamedTuple):
    """The samples of one group stored column-wise. Sample ``j`` owns ``[offsets[j], offsets[j+1])`` of the two
    concatenated arrays; the scalar columns are plain lists of length ``n``."""

    response_ids: np.ndarray  # [sum T] concatenated
    behavior_logprobs: np.ndarray  # [sum T] concatenated
    offsets: list[int]  # n + 1 entries, offsets[0] == 0
    reward: list[float]
    finish_reason: list[str]
    version_min: list[int]
    version_max: list[int]
    reward_failed: list[bool]

    def materialise(self) -> list[Sample]:
        ids, lps, off = self.response_ids, self.behavior_logprobs, self.offsets
        return [
            Sample(ids[a:b], lps[a:b], r, f, v0, v1, bad)
            for a, b, r, f, v0, v1, bad in zip(
                off, off[1:], self.reward, self.finish_reason, self.version_min, self.version_max, self.reward_failed
            )
        ]


class TrajectoryGroup:
    """All samples for one prompt, plus where and when they were made.

    Construct it with a list of :class:`Sample` (rollout workers, tests) or, on the receiving side, with
    :meth:`from_columns`; both behave the same to every reader."""

    __slots__ = ("group_id", "worker_id", "prompt_ids", "prompt_index", "ticket", "answer", "timings",
                 "_samples", "_columns")

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

    @classmethod
    def from_columns(cls, group_id: str, worker_id: int, prompt_ids: np.ndarray, columns: SampleColumns,
                     prompt_index: int = -1, ticket: int = -1, answer: str = "",
                     timings: Optional[dict[str, float]] = None) -> "TrajectoryGroup":
        """A group whose ``Sample`` objects are built lazily from ``columns`` (see the module docstring)."""
        g = cls(group_id, worker_id, prompt_ids, None, prompt_index, ticket, answer, timings)
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

    def __repr__(self) -> str:
        return (f"TrajectoryGroup(group_id={self.group_id!r}, worker_id={self.worker_id}, "
                f"n={self.num_samples}, prompt_len={len(self.prompt_ids)}, ticket={self.ticket})")
