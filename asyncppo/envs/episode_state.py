"""The state of one multi-turn episode in flight, and the finished forms it leaves as.

:class:`EpisodeState` is what :class:`asyncppo.envs.episodes.EpisodeEngine` keeps per episode: the response so far
(model and environment tokens, their log-probs and versions, the environment's runs), one reward per model turn,
the MoE routing record, and how a branch restarts it. :class:`EpisodeCompletion` / :class:`EpisodeGroup` are what
the engine hands back (the trajectory form of docs/environments.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from asyncppo.rollout.engine import Completion, FinishedGroup, SamplingSpec
from asyncppo.rollout.routing_record import finished, record_first


@dataclass
class EpisodeCompletion(Completion):
    """One finished episode: the response after the prompt (model and environment tokens), its mask as run-lengths
    of environment segments (``env_runs``: int64 ``[E, 2]`` rows ``(start, length)``), one reward per model turn,
    and why it ended (``done``, ``max_turns``, ``truncated`` or a fault kind)."""

    env_runs: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    turn_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    ended: str = "done"

    @property
    def reward(self) -> float:
        return float(self.turn_rewards.sum())


@dataclass
class EpisodeGroup(FinishedGroup):
    """A group whose ``n`` episodes all ended. ``dropped``: an environment fault under ``env.on_error=drop``
    discarded it (the caller releases its admission slot and does not train it); ``detail`` says why."""

    dropped: bool = False
    detail: str = ""
    prompt_ids: list = field(default_factory=list)  # the prompt the episodes rendered (the record's prompt)


@dataclass
class EpisodeState:
    group: str
    index: int
    env: Any
    prompt_ids: list
    spec: SamplingSpec
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    env_runs: list = field(default_factory=list)
    turn_rewards: list = field(default_factory=list)
    last_finish: str = "stop"
    model_stop_text: str = ""
    ended: Optional[str] = None
    routing: Optional[np.ndarray] = None  # MoE engines recording experts: [prompt + ids, layers, top_k] (-1: none)
    unrecorded: bool = False  # a turn came back without a record: the episode has none
    first_messages: list = field(default_factory=list)  # what init returned: the prompt's messages (branches)
    dropped_turns: int = 0  # model turns of earlier branches
    branch_version: int = 0  # the version a branch's opening segment carries (the engine's when the branch began)
    earlier: list = field(default_factory=list)  # earlier branches kept as samples (env.agent_branches=all)

    @property
    def turn_number(self) -> int:
        """Model turns so far, every branch's."""
        return self.dropped_turns + len(self.turn_rewards)

    @property
    def request_key(self) -> str:
        return f"{self.group}|ep{self.index}|turn{self.turn_number}"

    def append_env(self, env_ids: list) -> None:
        """An environment segment: masked, logprob 0, the version of the model token before it (the convention of
        docs/environments.md; a branch's opening segment, before any model token: ``branch_version``)."""
        self.env_runs.append((len(self.ids), len(env_ids)))
        self.ids += env_ids
        self.logprobs += [0.0] * len(env_ids)
        self.versions += [self.versions[-1] if self.versions else self.branch_version] * len(env_ids)

    def restart(self, keep: bool = False) -> int:
        """Start a new branch: the response so far is set aside (the prompt and its routing records stand; the rest
        is recomputed by the next turn's prefill), kept as a finished sample of its own with ``keep`` (trained with
        the episode's reward, :func:`completions_of`), else dropped. Returns its model tokens."""
        dropped = len(self.ids) - sum(n for _, n in self.env_runs)
        if keep and dropped:
            self.earlier.append(completion_of(self, ended="branch"))
        self.branch_version = self.versions[-1] if self.versions else self.branch_version  # the caller may raise it
        self.dropped_turns += len(self.turn_rewards)
        self.ids, self.logprobs, self.versions, self.env_runs, self.turn_rewards = [], [], [], [], []
        self.model_stop_text = ""
        if self.routing is not None:
            self.routing = self.routing[:len(self.prompt_ids)].copy()
        return dropped


def stitch_routing(ep: EpisodeState, record: Optional[np.ndarray]) -> None:
    """Fold one turn's record of experts (every position of its request: the whole prefix, then its own tokens)
    into the episode's. A position an earlier turn recorded keeps that record: the choice made when the engine first
    computed it, the one the tokens sampled after it attended to; the turn's request recomputed it (no prefix
    caching while recording). The rest comes from this turn: the previous turn's last token and the environment's
    tokens (computed by this turn's prefill, before it sampled anything) and its own tokens."""
    if ep.unrecorded or record is None:
        ep.unrecorded, ep.routing = True, None
        return
    ep.routing = record_first(ep.routing, 0, record)  # the first record of a position wins (routing_record.py)


def _episode_routing(ep: EpisodeState) -> Optional[np.ndarray]:
    """The episode's record over prompt + response (-1 where none: the last token, never run)."""
    if ep.routing is None:
        return None
    return finished(ep.routing, len(ep.prompt_ids) + len(ep.ids), ep.routing.shape[1:])


def completion_of(ep: EpisodeState, ended: Optional[str] = None) -> EpisodeCompletion:
    """The episode's response as it stands, as a finished sample (``ended``: why, by default the episode's own)."""
    finish = "length" if ep.ended == "truncated" else ep.last_finish
    return EpisodeCompletion(
        token_ids=np.asarray(ep.ids, dtype=np.int32), logprobs=np.asarray(ep.logprobs, dtype=np.float32),
        finish_reason=finish, versions=np.asarray(ep.versions, dtype=np.int64),
        routed_experts=_episode_routing(ep),
        env_runs=np.asarray(ep.env_runs, dtype=np.int64).reshape(-1, 2),
        turn_rewards=np.asarray(ep.turn_rewards, dtype=np.float64), ended=ended or ep.ended or "done")


def completions_of(ep: EpisodeState) -> list[EpisodeCompletion]:
    """The samples an ended episode trains: its earlier branches kept under ``env.agent_branches=all`` (``ended``
    ``"branch"``; each paid the episode's reward at its last turn, the outcome its turns led to), then its final
    branch."""
    final = completion_of(ep)
    earlier = []
    for c in ep.earlier:
        paid = np.zeros_like(c.turn_rewards)
        if len(paid):
            paid[-1] = final.reward
        earlier.append(dataclasses.replace(c, turn_rewards=paid))
    return earlier + [final]
