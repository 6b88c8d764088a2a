"""The learner process of embodied runs: :class:`~asyncppo.learner.service.LearnerService` with segments for groups.

Everything around the update is the LLM learner's: the same sockets (bound by ``LearnerService.setup``; the
trajectory receiver decodes :mod:`asyncppo.stream.segments` records checked against this environment's spaces),
the same admission controller and ticket-ordered :class:`~asyncppo.staleness.StalenessBuffer` (a segment takes one
ticket, so every env step trained at version ``v`` was chosen by weights ``>= v - k``), the same weight broadcast
(the actor-critic's ``state_dict``, observation statistics included), the same metrics sinks and shutdown. Only
the update (:mod:`asyncppo.learner.embodied_update`) and the metrics it adds differ:

* ``episode/return_mean``, ``episode/length_mean``, ``episode/count`` over the episodes that ended in the step's
  segments (raw environment reward), and ``episode/return_recent`` over the last 100 episodes;
* ``throughput/env_steps_per_s`` (env steps trained per wall second) and ``throughput/rollout_env_steps_per_s``
  (env steps per second of worker time spent stepping and acting);
* the staleness (``staleness/min|mean|max|token_mean``), busy (``util/*``) and KL / clip (``actor/*``) metrics of
  LLM runs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from typing import Optional

import numpy as np
import torch

from asyncppo.learner.service import LearnerService
from asyncppo.metrics import BusyMeter, MetricsLogger, RateMeter, lag_stats, token_lag_stats
from asyncppo.stream.endpoints import Endpoints
from asyncppo.stream.validate import SegmentDoor

log = logging.getLogger("asyncppo.learner")


class EmbodiedLearner(LearnerService):
    def __init__(self, cfg, num_workers: int, output_dir: str, keys=None):
        super().__init__(cfg, model_path="", num_workers=num_workers, output_dir=output_dir, keys=keys)

    def setup(self) -> Endpoints:
        from asyncppo.envs.spaces import describe_env
        from asyncppo.stream.segments import segment_decoder

        if self.cfg.trainer.resume_from:
            raise ValueError("trainer.resume_from is not supported for embodied runs yet")
        self.desc = describe_env(self.cfg.env)
        endpoints = super().setup()
        self.receiver.decode = segment_decoder(self.desc.segment_spec)
        return endpoints

    def _take_batch(self, buffer, n: int) -> list:
        """Block until ``n`` segments (the lowest outstanding tickets) are in; fail loudly if the workers stop.
        (The LLM learner's version also filters groups by reward variance, which means nothing for segments.)"""
        deadline = time.monotonic() + self.cfg.cluster.timeout_s
        out: list = []
        while len(out) < n:
            out += buffer.take(n - len(out), self.version, timeout_s=1.0)
            if self._feeder is not None and not self._feeder.alive:
                raise RuntimeError(f"the segment feeder stopped: {self._feeder.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no segments for {self.cfg.cluster.timeout_s:.0f}s at policy version {self.version} "
                    f"({len(out)}/{n}; waiting for tickets {buffer.missing(n)[:8]}): are the env workers alive? "
                    "(cluster.timeout_s)")
            if out:
                deadline = time.monotonic() + self.cfg.cluster.timeout_s
        return out

    def _run(self, master_addr: Optional[str], master_port: Optional[int]) -> dict:
        from asyncppo.envs.policy import ActorCritic
        from asyncppo.learner.embodied_update import EmbodiedPPO
        from asyncppo.staleness import Feeder, StalenessBuffer

        cfg, ro, tr = self.cfg, self.cfg.rollout, self.cfg.trainer
        torch.manual_seed(tr.seed)
        device = torch.device("cuda" if torch.cuda.is_available() and cfg.cluster.train_gpus > 0 else "cpu")
        policy = ActorCritic(self.desc.policy_spec(cfg)).to(device)
        updater = EmbodiedPPO(cfg, policy, device)
        logger = MetricsLogger(self.output_dir, console=tr.logger.console, jsonl=tr.logger.jsonl,
                               wandb=tr.logger.wandb, wandb_mode=tr.logger.wandb_mode,
                               wandb_project=tr.logger.wandb_project, wandb_run_name=tr.logger.wandb_run_name,
                               total_steps=tr.total_steps, config=dataclasses.asdict(cfg),
                               log_every=tr.logger.log_every)
        self._closables.append(logger)
        logger.message(f"waiting for {self.num_workers} env worker(s) to join the weight-sync group")
        sender = self.fanout  # the LLM learner's weight sync: one pair group per worker (sync/fanout.py)
        self._state["sender"] = sender
        sender.start()  # the join deadline counts from here, not from the learner's own start-up
        sender.wait_joined(range(self.num_workers), timeout_s=cfg.cluster.timeout_s)
        B = ro.rollout_batch_size
        buffer = StalenessBuffer(ro.max_staleness, capacity_groups=max((ro.max_staleness + 2) * B, 64),
                                 on_drop=self._release_dropped, on_take=lambda g: self.admission.consumed(g.ticket),
                                 order=self.admission, response_length=cfg.env.segment_length)
        self.door = SegmentDoor(self.admission_server, lambda: self.version)
        feeder = Feeder(self.receiver, buffer, validator=self.door)
        self._closables.insert(0, feeder)
        self._feeder = feeder

        def weights() -> dict:
            return {k: v.detach() for k, v in policy.state_dict().items()}

        # Workers start at version -1 and act only after loading this push: version 0 is the same network everywhere.
        self.control.publish(version=0, weights_version=0)
        sender.push_async(weights(), 0)
        recent: collections.deque = collections.deque(maxlen=100)
        env_rate, train_busy, rollout_busy = RateMeter(), BusyMeter(), BusyMeter()
        t_start, env_steps, pushed = time.perf_counter(), 0, 0
        summary: dict = {"output_dir": self.output_dir, "env": cfg.env.id}
        try:
            for step in range(1, tr.total_steps + 1):
                t_step = time.perf_counter()
                segments = self._take_batch(buffer, B)
                t_work = time.perf_counter()
                metrics = updater.step(segments)
                metrics.update(lag_stats(self.version, [s.version_min for s in segments]))
                metrics.update(token_lag_stats(self.version, segments))
                self.version += 1
                last = step == tr.total_steps
                if self.version % ro.sync_every == 0 and not last:
                    sender.wait()
                    self.control.publish(version=self.version, weights_version=self.version)
                    sender.push_async(weights(), self.version)
                    pushed = self._state["pushed_version"] = self.version
                if last:
                    self.admission_server.stop()
                self.admission.set_version(self.version)
                self.control.publish(version=self.version, weights_version=pushed)
                train_busy.add(time.perf_counter() - t_work)
                n_steps = sum(s.num_envs * s.num_steps for s in segments)
                env_steps += n_steps
                env_rate.add(n_steps)
                rollout_busy.add(sum(s.timings.get("busy_s", 0.0) for s in segments))
                returns = np.concatenate([s.episode_returns for s in segments])
                lengths = np.concatenate([s.episode_lengths for s in segments])
                recent.extend(returns.tolist())
                if returns.size:
                    metrics.update({"episode/return_mean": float(returns.mean()),
                                    "episode/length_mean": float(lengths.mean()),
                                    "episode/return_max": float(returns.max())})
                rollout_s = sum(s.timings.get("busy_s", 0.0) for s in segments)
                stats = buffer.stats()
                metrics.update({
                    "policy_version": self.version,
                    "env_steps": env_steps,
                    "episode/count": float(returns.size),
                    "episode/return_recent": float(np.mean(recent)) if recent else 0.0,
                    "throughput/env_steps_per_s": env_rate.rate(),
                    "throughput/rollout_env_steps_per_s": n_steps / max(rollout_s, 1e-9),
                    "util/rollout_busy": rollout_busy.fraction(self.num_workers),
                    "util/train_busy": train_busy.fraction(),
                    "time/step_s": time.perf_counter() - t_step,
                    "time/wait_s": t_work - t_step,
                    "sync/push_s": max((s.timings.get("push_s_max", 0.0) for s in segments), default=0.0),
                    "rollout/inflight_updates": float(sum(s.timings.get("weight_loads", 0.0) for s in segments)),
                    "staleness/version_spread_max": stats.get("version_spread_max", 0),
                    "buffer/size": stats.get("size", 0),
                    "buffer/dropped_stale": stats.get("dropped_stale", 0),
                    "stream/rejected": sum(self.receiver.rejected.values()),
                    "stream/rejected_content": self.door.num_rejected,
                })
                for meter in (env_rate, train_busy, rollout_busy):
                    meter.reset()
                logger.log(step, metrics)
            sender.wait()
            final_dir = os.path.join(self.output_dir, "final")
            os.makedirs(final_dir, exist_ok=True)
            torch.save({"policy": policy.state_dict(), "spec": dataclasses.asdict(policy.spec),
                        "optimizer": updater.state_dict(), "version": self.version},
                       os.path.join(final_dir, "policy.pt"))
            wall = time.perf_counter() - t_start
            summary.update(steps=tr.total_steps, version=self.version, env_steps=env_steps, wall_s=wall,
                           env_steps_per_s=env_steps / max(wall, 1e-9),
                           return_recent=float(np.mean(recent)) if recent else None,
                           buffer=buffer.stats(), rejected=dict(self.receiver.rejected),
                           rejected_segments=dict(self.door.rejected))
            with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1, default=str)
            logger.message(f"done: {summary}")
            return summary
        finally:
            self._state["pushed_version"] = pushed
