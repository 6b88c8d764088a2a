"""Accumulate one env worker's steps into :class:`~asyncppo.stream.segments.EnvSegment` records.

Kept apart from the worker's control flow so the bookkeeping that decides what GAE will see - which step was
terminated or truncated, which final observation belongs to a truncated step, which episodes ended, which version
chose each step - can be tested with a real gymnasium env and no sockets.
"""

from __future__ import annotations

import numpy as np

from asyncppo.envs.spaces import EnvDescription, EnvError
from asyncppo.stream.segments import EnvSegment


def _check_finite(what: str, arr: np.ndarray, env_id: str, step: int, worker_id: int) -> None:
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = np.flatnonzero(~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1))
        raise EnvError(f"env.id={env_id!r} returned a NaN or infinite {what} (worker {worker_id}, vector env index "
                       f"{bad.tolist()[:8]}, segment step {step}); asyncppo refuses to train on it. Fix or wrap the "
                       "environment (e.g. clip or replace bad values) and launch again")


class SegmentBuilder:
    """Steps in, segments out. ``obs`` is the observation the next action is chosen for."""

    def __init__(self, desc: EnvDescription, num_envs: int, length: int, worker_id: int = 0):
        self.desc, self.N, self.T, self.worker_id = desc, num_envs, length, worker_id
        self.ep_return = np.zeros(num_envs, np.float64)
        self.ep_length = np.zeros(num_envs, np.int64)
        self.t = 0
        self.obs: np.ndarray | None = None
        self._timings: dict[str, float] = {}
        self._alloc()

    def _alloc(self, env_errors: float = 0.0) -> None:
        """Empty arrays for the next segment; ``env_errors``: environment errors not yet reported in a segment."""
        N, T, S = self.N, self.T, self.desc.obs_shape
        self._obs = np.zeros((N, T, *S), np.float32)
        if self.desc.discrete:
            self._act = np.zeros((N, T), np.int64)
        else:
            self._act = np.zeros((N, T, self.desc.action_dim), np.float32)
        self._logp = np.zeros((N, T), np.float32)
        self._rew = np.zeros((N, T), np.float32)
        self._term = np.zeros((N, T), bool)
        self._trunc = np.zeros((N, T), bool)
        self._ver = np.zeros(T, np.int64)
        self._final: list[tuple[int, np.ndarray]] = []
        self._episodes: list[tuple[float, int]] = []
        self._timings = {"env_s": 0.0, "policy_s": 0.0, "wait_s": 0.0, "weight_loads": 0.0, "push_s_max": 0.0,
                         "load_s": 0.0, "env_errors": env_errors}
        self.t = 0

    def discard(self) -> None:
        """Drop the segment being collected (its ticket belonged to a learner that died); the episodes go on."""
        self._alloc(self._timings.get("env_errors", 0.0))

    def restart(self, obs: np.ndarray) -> None:
        """The environment raised and was made again: the segment being collected and the unfinished episodes are
        dropped (their steps are lost, their returns never reported), and collection starts over from ``obs``, the
        fresh reset. The error is counted in the next segment's ``env_errors``."""
        self._alloc(self._timings.get("env_errors", 0.0) + 1.0)
        self.ep_return[:] = 0.0
        self.ep_length[:] = 0
        self.start(obs)

    def start(self, obs: np.ndarray) -> None:
        _check_finite("observation", obs, self.desc.env_id, 0, self.worker_id)
        self.obs = obs.astype(np.float32, copy=False)

    @property
    def full(self) -> bool:
        return self.t == self.T

    def note_wait(self, seconds: float) -> None:
        self._timings["wait_s"] += seconds

    def note_weight_load(self, load_s: float, since_announce_s: float) -> None:
        self._timings["weight_loads"] += 1.0
        self._timings["load_s"] += load_s
        self._timings["push_s_max"] = max(self._timings["push_s_max"], max(0.0, since_announce_s))

    def record(self, actions, logprobs, reward, terminated, truncated, next_obs, info, version: int,
               policy_s: float = 0.0, env_s: float = 0.0) -> None:
        """One vector step: the action chosen for ``self.obs`` and what the env returned (SAME_STEP autoreset)."""
        t, env_id = self.t, self.desc.env_id
        if t >= self.T:
            raise RuntimeError("segment is full: call finish() first")
        reward = np.asarray(reward, np.float64)
        terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
        _check_finite("reward", reward.reshape(self.N, 1), env_id, t, self.worker_id)
        _check_finite("observation", next_obs, env_id, t, self.worker_id)
        self._obs[:, t] = self.obs
        self._act[:, t] = actions
        self._logp[:, t] = logprobs
        self._rew[:, t] = reward
        self._term[:, t] = terminated
        self._trunc[:, t] = truncated
        self._ver[t] = version
        self.ep_return += reward
        self.ep_length += 1
        for i in np.flatnonzero(terminated | truncated):
            self._episodes.append((float(self.ep_return[i]), int(self.ep_length[i])))
            self.ep_return[i], self.ep_length[i] = 0.0, 0
            if truncated[i] and not terminated[i]:
                final = np.asarray(info["final_obs"][i], np.float32)
                _check_finite("final observation", final[None], env_id, t, self.worker_id)
                self._final.append((int(i) * self.T + t, final))
        self.obs = next_obs.astype(np.float32, copy=False)
        self._timings["env_s"] += env_s
        self._timings["policy_s"] += policy_s
        self.t += 1

    def finish(self, ticket: int, segment_id: str) -> EnvSegment:
        """The full segment (bootstrap observation = the current ``obs``); starts the next one."""
        if not self.full:
            raise RuntimeError(f"segment has {self.t} of {self.T} steps")
        self._final.sort(key=lambda p: p[0])
        S = self.desc.obs_shape
        tm = dict(self._timings)
        tm["busy_s"] = tm["env_s"] + tm["policy_s"]
        tm["env_steps"] = float(self.N * self.T)
        seg = EnvSegment(
            obs=self._obs, actions=self._act, logprobs=self._logp, rewards=self._rew, terminated=self._term,
            truncated=self._trunc, versions=self._ver, bootstrap_obs=self.obs.copy(),
            final_index=np.array([p[0] for p in self._final], np.int64),
            final_obs=np.stack([p[1] for p in self._final]).astype(np.float32) if self._final
            else np.zeros((0, *S), np.float32),
            episode_returns=np.array([e[0] for e in self._episodes], np.float64),
            episode_lengths=np.array([e[1] for e in self._episodes], np.int64),
            segment_id=segment_id, worker_id=self.worker_id, ticket=int(ticket), timings=tm,
        )
        self._alloc()
        return seg
