"""The environment rollout worker: step a gymnasium vector env with the newest weights, stream fixed-length segments.

One turn of :meth:`EnvWorker.run`'s loop (the skeleton of :mod:`asyncppo.rollout.skeleton`, shared with the LLM
worker, with an env step for a decode step):

1. **control** - read the learner's newest state; stop if asked.
2. **weights** - if newer weights were announced, join the broadcast and load them *now*, between two env steps:
   a segment in progress goes on with the new policy, and every step records the version that chose it.
3. **admit** - a segment starts only with an admission ticket whose ``min_version`` our weights satisfy (the same
   tickets, and so the same staleness bound ``k``, as LLM groups); the next ticket is requested while the current
   segment is collected, so no step waits on a round trip.
4. **step** - one vector-env step; after ``env.segment_length`` steps the segment is sent and the next one starts
   from the current observations (episodes continue across segments; only the learner's GAE sees the cut, as a
   bootstrap from ``bootstrap_obs``).

An environment that returns a NaN or infinite observation or reward is a bug in the environment, not noise: the
worker raises :class:`EnvError` naming the env, the index and the step, and the run ends with that message.

An environment whose ``step`` *raises* is treated as a fault of that moment (a simulator that lost a contact
solve, a remote environment's dropped connection), not of the run: the vector env is closed and made again (one
sub-env raising leaves the others half-stepped, so none of its state is trusted), the segment being collected is
discarded with its unfinished episodes (its env steps are lost, no data is), and the same ticket's segment starts
again from the fresh reset. The first error is told with its message; every one is counted (``env_errors``, the
learner's ``env/errors``). Only an environment that raises :data:`MAX_ERRORS_IN_ROW` times in a row, with no
successful step between, is taken for broken: the worker raises :class:`EnvError` with the last error, and the
launcher's replacement budget decides what follows (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.models.actor_critic import ActorCritic
from asyncppo.envs.segments import SegmentBuilder
from asyncppo.envs.spaces import EnvError, describe_env, make_vector_env
from asyncppo.rollout.meter import LinkCounters
from asyncppo.rollout.skeleton import WorkerSkeleton
from asyncppo.staleness.order import take_startable
from asyncppo.stream.endpoints import Endpoints
from asyncppo.stream.group_ids import group_key
from asyncppo.stream.segments import encode_segment

log = logging.getLogger("asyncppo.envs")

#: Raises of the environment in a row, each followed by a fresh vector env, before the worker gives up on it.
MAX_ERRORS_IN_ROW = 3


class EnvWorker(WorkerSkeleton):
    role = "env worker"

    def __init__(self, cfg: AsyncPPOConfig, worker_id: int, num_workers: int, endpoints: Endpoints | None,
                 device: str = "cpu", incarnation: int = 0):
        # incarnation: a replacement of a worker that died (launch/supervise.py) names its group and segments by it
        super().__init__(cfg, worker_id, num_workers, endpoints, incarnation=incarnation)
        self.device = torch.device(device)
        self.version = -1  # no weights yet: the learner pushes version 0 before any ticket can be served
        self.stats = {"segments_sent": 0, "env_steps": 0, "episodes": 0, "weight_loads": 0, "env_errors": 0}
        self.links = LinkCounters(self)  # the clients' re-created sockets, reported with each segment
        self._ticket = None
        self._errors_in_row = 0

    # ------------------------------------------------------------------------------------------------------------
    def _open_workload(self) -> None:
        """The vector env, the policy that acts in it and the segment builder, started from the first reset."""
        cfg, e = self.cfg, self.cfg.env
        self.desc = describe_env(e)
        self._seed = seed = cfg.trainer.seed + 1000 * (self.worker_id + 1)
        torch.manual_seed(seed)
        self.policy = ActorCritic(self.desc.policy_spec(cfg)).to(self.device).eval()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        obs = self._new_env(seed)
        self.builder = SegmentBuilder(self.desc, e.num_envs, e.segment_length, self.worker_id)
        self.builder.start(obs)

    def _new_env(self, seed: int) -> np.ndarray:
        """A vector env (closed with the worker), reset with ``seed``; its first observations."""
        self.env = make_vector_env(self.cfg.env, self.cfg.env.num_envs)
        self._closables.append(self.env)
        obs, _ = self.env.reset(seed=seed)
        return np.asarray(obs)

    def _open(self) -> None:
        super()._open()
        e = self.cfg.env
        print(f"[asyncppo] env worker {self.worker_id}"
              + (f" (incarnation {self.incarnation})" if self.incarnation else "")
              + f": pid {os.getpid()}, {e.num_envs} x {e.id} ({e.vectorization}), segments of "
              f"{e.segment_length} steps, obs {self.desc.obs_shape}, "
              f"{'discrete' if self.desc.discrete else 'continuous'} actions ({self.desc.action_dim})", flush=True)

    # ------------------------------------------------------------------------------------------------------------
    def _on_weights_announced(self, state) -> bool:
        self._load_weights(state)
        return True  # loaded between two env steps; the next turn reads control again

    def _work(self) -> None:
        # the phase is what the launcher's control ping reads (launch/hang.py): waiting for a ticket or for weights
        # is the learner's wait; stepping must move the progress counter, so an env whose step never returns is
        # found hung after the hang timeout and the worker replaced
        if self._ticket is None and not self._next_ticket():
            self.phase = "waiting"
            return
        if self._ticket.min_version > self.version:  # the ticket needs newer weights than ours
            # a ticket granted again (a segment refused or dropped) is for the batch being trained and may wait
            # behind ours: start it first; and while every ticket held waits for a push keep a request open, so
            # that such a ticket can reach us (staleness/order.py, docs/staleness.md)
            self._pending.extend(self.admission.poll_granted(0.0))
            ready = take_startable(self._pending, self.version)
            if ready is not None:  # nothing was collected under the ticket in hand yet: swap them
                self._pending.appendleft(self._ticket)
                self._ticket = ready
                return
            if (self._waits_for_a_push((self._ticket, *self._pending)) and not self.admission.open_requests
                    and not self.admission.stopped):
                self.admission.request(1)
            self.phase = "waiting"
            needed = self._ticket.min_version
            self._state = self.control.wait_for(lambda s: s.stop or s.weights_version >= needed, 0.1) or self._state
            return
        self.phase = "generating"
        self._step()

    def _drop_work(self, position) -> None:
        """A restarted learner: the segment being collected loses its ticket; the env steps on from where it is."""
        self._ticket = None
        self.builder.discard()

    def _load_weights(self, state) -> None:
        t0 = time.perf_counter()
        self.phase = "loading"
        version, tensors = self.receiver.receive()
        self.policy.load_state_dict(dict(tensors))
        self.version = version
        self.stats["weight_loads"] += 1
        self.progress += 1
        self.phase = "waiting"  # until the next turn says what it does
        self.builder.note_weight_load(time.perf_counter() - t0, time.time() - state.time)
        log.info("env worker %d loaded weights v%d", self.worker_id, version)

    def _next_ticket(self) -> bool:
        """Take a granted ticket if one is at hand (waiting briefly when none is), keeping one request ahead."""
        if not self._pending and not self.admission.open_requests and not self.admission.stopped:
            self.admission.request(1)
        t0 = time.perf_counter()
        self._pending.extend(self.admission.poll_granted(0.0 if self._pending else 0.2))
        self.builder.note_wait(time.perf_counter() - t0)
        if not self._pending:
            return False
        self._ticket = self._pending.popleft()
        if not self.admission.open_requests and not self.admission.stopped:
            self.admission.request(1)  # the next segment's ticket travels while this one is collected
        return True

    def _step(self) -> None:
        b = self.builder
        t0 = time.perf_counter()
        x = torch.as_tensor(b.obs, dtype=torch.float32, device=self.device)
        actions, logprobs = self.policy.act(x, self.generator)
        env_actions = actions if self.desc.discrete else np.clip(actions, self.desc.action_low, self.desc.action_high)
        t1 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = self.env.step(env_actions)
        except Exception as exc:  # noqa: BLE001 - the environment's own failure: recovered (module docstring)
            self._recover(exc)
            return
        self._errors_in_row = 0
        t2 = time.perf_counter()
        b.record(actions, logprobs, reward, terminated, truncated, np.asarray(obs), info, self.version,
                 policy_s=t1 - t0, env_s=t2 - t1)
        self.stats["env_steps"] += self.cfg.env.num_envs
        self.progress += 1
        if b.full:
            self._send(b.finish(self._ticket.index, group_key(self.worker_id, self.incarnation, self._seq)))
            self._seq += 1
            self._ticket = None

    def _recover(self, exc: Exception) -> None:
        """The environment raised in ``step``: a fresh vector env, the segment collected again (module docstring)."""
        self.stats["env_errors"] += 1
        self._errors_in_row += 1
        what = f"{type(exc).__name__}: {exc}"[:300]
        if self._errors_in_row >= MAX_ERRORS_IN_ROW:
            raise EnvError(f"env.id={self.cfg.env.id!r} raised {self._errors_in_row} times in a row (worker "
                           f"{self.worker_id}, a fresh vector env each time); the last: {what}") from exc
        if self.stats["env_errors"] == 1:  # told once, with the error; counted from then on
            print(f"[asyncppo] env worker {self.worker_id}: the environment raised in step ({what}); making a fresh "
                  "vector env and collecting the segment again (counted as env/errors)", flush=True)
        log.warning("env worker %d: environment error %d: %s", self.worker_id, self.stats["env_errors"], what)
        try:
            self.env.close()
        except Exception:  # a broken env may not close cleanly; its replacement is what matters
            pass
        self._closables.remove(self.env)
        # new episodes, not a replay of the ones that led here
        self.builder.restart(self._new_env(self._seed + 7919 * self.stats["env_errors"]))

    def _send(self, segment) -> None:
        segment.timings.update(self.links.take())
        frame = encode_segment(segment)
        phase, self.phase = self.phase, "sending"  # the learner not taking a segment is not this worker's hang
        sent = self._send_until_sent(lambda: self.sender.send_encoded(frame, timeout_s=1.0))
        self.phase = phase
        if not sent:
            return
        self.stats["segments_sent"] += 1
        self.progress += 1
        self.stats["episodes"] += int(segment.episode_returns.shape[0])


__all__ = ["EnvWorker", "EnvError"]
