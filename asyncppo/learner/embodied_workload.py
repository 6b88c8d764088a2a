"""The embodied workload of the learner loop (learner/loop.py): segments of gymnasium env steps, trained with PPO.

Everything around the update is the loop's, as for LLM runs: the same sockets (the trajectory receiver decodes
:mod:`asyncppo.stream.segments` records checked against this environment's spaces), the same admission controller and
ticket-ordered staleness buffer (a segment takes one ticket, so every env step trained at version ``v`` was chosen by
weights ``>= v - k``), the same weight push (the actor-critic's ``state_dict``, observation statistics included),
the same metrics sinks and shutdown. What this workload adds is the update (:mod:`asyncppo.learner.embodied_update`)
and its metrics:

* ``episode/return_mean``, ``episode/length_mean``, ``episode/count`` over the episodes that ended in the step's
  segments (raw environment reward), and ``episode/return_recent`` over the last 100 episodes;
* ``throughput/env_steps_per_s`` (env steps trained per wall second) and ``throughput/rollout_env_steps_per_s``
  (env steps per second of worker time spent stepping and acting);
* ``env/errors``: raises of the environment's ``step`` the step's segments recovered from (envs/worker.py);
* the staleness (``staleness/min|mean|max|token_mean``), busy (``util/*``), KL / clip (``actor/*``) and worker
  replacement (``workers/restarts|hung|tickets_returned|sync_failures``) metrics of LLM runs.

Env workers start at version -1 and act only after loading the learner's first push, so version 0 is the same
network everywhere. Checkpoints (every ``trainer.save_every`` versions) hold the policy, its optimiser and the
return window (learner/embodied_checkpoint.py); ``trainer.resume_from`` continues from one, and the launcher's
learner restart uses the same path. The final policy is saved too.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Optional

import numpy as np
import torch

from asyncppo.learner.embodied_checkpoint import load_embodied, resolve_embodied, save_embodied
from asyncppo.learner.embodied_update import EmbodiedPPO
from asyncppo.metrics import BusyMeter, RateMeter
from asyncppo.models.actor_critic import ActorCritic
from asyncppo.stream.redial import RECONNECT_KEYS
from asyncppo.stream.validate import SegmentDoor

log = logging.getLogger("asyncppo.learner")


class EmbodiedWorkload:
    workers_name = "env worker"
    evaluates_on_engines = False
    record_kind = "segment"
    pushes_initial_weights = True  # env workers hold no weights until the learner's first push
    streamed = False

    def __init__(self, cfg, num_workers: int, output_dir: str, policy_spec=None):
        self.cfg, self.num_workers, self.output_dir = cfg, num_workers, output_dir
        self.policy_spec = policy_spec  # the environment's network shape (envs/spaces.py), set before build()
        self.response_length = cfg.env.segment_length
        self.recent: collections.deque = collections.deque(maxlen=100)
        self.env_steps = 0
        self.segment_door: Optional[SegmentDoor] = None
        self.resume: Optional[tuple[str, int]] = None  # (checkpoint dir, version) being resumed from

    def start_version(self) -> int:
        if self.cfg.trainer.resume_from and self.resume is None:
            self.resume = resolve_embodied(self.cfg.trainer.resume_from)
        return self.resume[1] if self.resume else 0

    def saved_position(self) -> dict:
        return {}  # env workers draw no dataset: nothing to position

    def saved_window(self) -> Optional[dict]:
        return None  # embodied runs keep a fixed window

    def resumed_from(self) -> Optional[str]:
        return self.resume[0] if self.resume else None

    def build(self, device, wiring) -> None:
        self.wiring = wiring
        self.policy = ActorCritic(self.policy_spec).to(device)
        self.updater = EmbodiedPPO(self.cfg, self.policy, device)
        if self.resume is not None:
            state = load_embodied(self.resume[0])
            self.policy.load_state_dict(state["policy"])
            self.updater.load_resume_state(state["updater"])
            self.recent.extend(state.get("recent", []))
            self.env_steps = int(state.get("env_steps", 0))

    def follow(self) -> int:
        raise RuntimeError("embodied runs train on one learner rank")

    # --- records in --------------------------------------------------------------------------------------------
    def door(self, current_version):
        self.segment_door = SegmentDoor(self.wiring.admission_server, current_version)
        return self.segment_door, None

    def on_take(self, segment) -> None:
        self.wiring.admission.consumed(segment.ticket)

    def start_step(self) -> None:
        """Nothing to reset: segments are not filtered (reward variance means nothing for them)."""

    def keep(self, segments: list) -> list:
        return segments

    def late_error(self, buffer, n: int, got: int, version: int) -> Exception:
        timeout_s = self.cfg.cluster.timeout_s
        return TimeoutError(
            f"no segments for {timeout_s:.0f}s at policy version {version} ({got}/{n}; waiting for tickets "
            f"{buffer.missing(n)[:8]}): are the env workers alive? (cluster.timeout_s)")

    # --- one step ----------------------------------------------------------------------------------------------
    def begin(self, t_train0: float) -> None:
        self.env_rate, self.train_busy, self.rollout_busy = RateMeter(), BusyMeter(), BusyMeter()
        self.t_start = t_train0

    def update(self, segments: list, version: int):
        return self.updater.step(segments), None

    def push(self, version: int) -> None:
        self.wiring.fanout.push_async({k: v.detach() for k, v in self.policy.state_dict().items()}, version)

    def step_metrics(self, step: int, version: int, segments: list, batch, t_step: float, t_work: float,
                     buffer_stats: dict) -> dict:
        self.train_busy.add(time.perf_counter() - t_work)
        n_steps = sum(s.num_envs * s.num_steps for s in segments)
        self.env_steps += n_steps
        self.env_rate.add(n_steps)
        rollout_s = sum(s.timings.get("busy_s", 0.0) for s in segments)
        self.rollout_busy.add(rollout_s)
        returns = self._episodes(segments)
        metrics = dict(self.episode_stats)
        metrics.update({
            "policy_version": version,
            "env_steps": self.env_steps,
            "episode/count": float(returns.size),
            "episode/return_recent": float(np.mean(self.recent)) if self.recent else 0.0,
            "throughput/env_steps_per_s": self.env_rate.rate(),
            "throughput/rollout_env_steps_per_s": n_steps / max(rollout_s, 1e-9),
            "util/rollout_busy": self.rollout_busy.fraction(self.num_workers),
            "util/train_busy": self.train_busy.fraction(),
            "time/step_s": time.perf_counter() - t_step,
            "time/wait_s": t_work - t_step,
            "time/wall_s": time.perf_counter() - self.t_start,  # the progress line's eta, the report's time axis
            "sync/push_s": max((s.timings.get("push_s_max", 0.0) for s in segments), default=0.0),
            "rollout/inflight_updates": float(sum(s.timings.get("weight_loads", 0.0) for s in segments)),
            # the environment raised in step and was made again (envs/worker.py): segments re-collected
            "env/errors": float(sum(s.timings.get("env_errors", 0.0) for s in segments)),
            # sockets the workers' admission clients / control subscribers re-created (stream/redial.py)
            **{f"rollout/{key}": float(sum(s.timings.get(key, 0.0) for s in segments)) for key in RECONNECT_KEYS},
            "staleness/version_spread_max": buffer_stats.get("version_spread_max", 0),
            "buffer/size": buffer_stats.get("size", 0),
            "buffer/dropped_stale": buffer_stats.get("dropped_stale", 0),
            "stream/rejected": sum(self.wiring.receiver.rejected.values()),
            "stream/rejected_content": self.segment_door.num_rejected,
        })
        # worker replacements (dead or hung env workers), as an LLM run reports them (launch/membership.py)
        metrics.update(self.wiring.ledger.metrics(self.wiring.fanout))
        for meter in (self.env_rate, self.train_busy, self.rollout_busy):
            meter.reset()
        return metrics

    def _episodes(self, segments: list) -> np.ndarray:
        """The returns of the episodes that ended in these segments (raw environment reward); their means go to
        ``episode_stats`` (empty when none ended) and the returns to the last-100 window."""
        returns = np.concatenate([s.episode_returns for s in segments])
        lengths = np.concatenate([s.episode_lengths for s in segments])
        self.recent.extend(returns.tolist())
        self.episode_stats = {"episode/return_mean": float(returns.mean()), "episode/length_mean":
                              float(lengths.mean()), "episode/return_max": float(returns.max())} if returns.size else {}
        return returns

    # --- evaluation, checkpoints, the end ----------------------------------------------------------------------
    def refresh_weights(self) -> None:
        """One rank: the trained policy is the saved one."""

    def checkpoint(self, version: int, logger, window: Optional[dict] = None) -> None:
        t0 = time.perf_counter()
        path = save_embodied(self.output_dir, version, {
            "policy": self.policy.state_dict(), "updater": self.updater.resume_state(),
            "recent": list(self.recent), "env_steps": self.env_steps}, keep=self.cfg.trainer.keep_checkpoints)
        logger.message(f"checkpoint {path} written in {time.perf_counter() - t0:.2f}s")

    def save_final(self, final_dir: str, version: int) -> None:
        os.makedirs(final_dir, exist_ok=True)
        torch.save({"policy": self.policy.state_dict(), "spec": dataclasses.asdict(self.policy.spec),
                    "optimizer": self.updater.state_dict(), "version": version},
                   os.path.join(final_dir, "policy.pt"))

    def run_info(self) -> dict:
        return {"env": self.cfg.env.id}

    def summary(self, buffer_stats: dict) -> dict:
        wall = time.perf_counter() - self.t_start
        return dict(env_steps=self.env_steps, wall_s=wall, env_steps_per_s=self.env_steps / max(wall, 1e-9),
                    return_recent=float(np.mean(self.recent)) if self.recent else None,
                    buffer=buffer_stats, rejected=dict(self.wiring.receiver.rejected),
                    rejected_segments=dict(self.segment_door.rejected))
