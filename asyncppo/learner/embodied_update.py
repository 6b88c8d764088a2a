"""The PPO update of embodied runs: segments in, one optimiser step per mini-batch, metrics out.

Everything is ``algo/``'s math on flat transition batches (a mini-batch is passed as one ``[1, M]`` row with an
all-ones mask, so ``token-mean`` is the plain mean): :func:`~asyncppo.algo.transitions.transition_gae` for the
advantages (bootstrapping from the final observation on truncation, not on termination),
:func:`~asyncppo.algo.policy_loss` for the clipped surrogate with the off-policy correction, and
:func:`~asyncppo.algo.value_loss` for the clipped / Huber value loss.

``algorithm.loss_type``:

* ``actor_critic`` - ``pg_loss - entropy_coef * entropy + vf_coef * vf_loss``, one backward pass, one optimiser
  over every parameter (the only choice with ``model.shared_backbone``: both heads move the shared trunk);
* ``actor`` - the policy loss and the value loss are minimised by two optimisers (``trainer.lr`` and
  ``trainer.critic_lr``) over the actor and the critic parameters, as in LLM runs.

Off-policy correction for the lag (``algorithm.off_policy_correction=decoupled``): before the epochs, the learner
recomputes the log-probs of the batch under its current policy (the *proximal* policy, observation statistics
included), clips the ratio around it, and weights each transition by ``min(pi_prox / pi_behav, cap)``, exactly as
for LLM tokens. ``none`` clips around the behaviour log-probs.

Reward scaling (``env.normalize_reward``) divides rewards by the running standard deviation of the discounted
return, per environment stream, as gymnasium's ``NormalizeReward`` does; it runs here rather than in the worker so
its statistics have one owner, and segments of one worker arrive in the order they were made (ticket order).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from asyncppo import algo
from asyncppo.algo.transitions import transition_gae
from asyncppo.models.actor_critic import ActorCritic
from asyncppo.learner.optim_step import clip_and_step
from asyncppo.learner.schedule import advance, scheduled_adamw
from asyncppo.stream.segments import EnvSegment


class ReturnScaler:
    """Scale rewards by ``1 / std(discounted return)``, the return tracked per ``(worker, env)`` stream."""

    def __init__(self, gamma: float, eps: float = 1e-8):
        self.gamma, self.eps = gamma, eps
        self.rms = algo.RunningMeanStd()
        self._ret: dict[int, np.ndarray] = {}

    def __call__(self, seg: EnvSegment, rewards: np.ndarray) -> np.ndarray:
        G = self._ret.get(seg.worker_id)
        if G is None or G.shape[0] != rewards.shape[0]:
            G = np.zeros(rewards.shape[0], np.float64)
        done = seg.terminated | seg.truncated
        returns = np.empty_like(rewards, dtype=np.float64)
        for t in range(rewards.shape[1]):
            G = G * self.gamma + rewards[:, t]
            returns[:, t] = G
            G = np.where(done[:, t], 0.0, G)
        self._ret[seg.worker_id] = G
        self.rms.update(torch.from_numpy(returns))
        return rewards / math.sqrt(self.rms.var + self.eps)

    def state_dict(self) -> dict:
        return {"rms": self.rms.state_dict(), "returns": {k: v.tolist() for k, v in self._ret.items()}}


class EmbodiedPPO:
    def __init__(self, cfg, policy: ActorCritic, device: torch.device):
        self.cfg, self.policy, self.device = cfg, policy, device
        a, t = cfg.algorithm, cfg.trainer
        self.actor_critic = a.loss_type == "actor_critic"
        if self.actor_critic:
            params = [(policy.parameters(), t.lr)]
        else:
            critic = [p for n, p in policy.named_parameters() if n.startswith(("critic_trunk.", "critic_head."))]
            actor = [p for n, p in policy.named_parameters() if not n.startswith(("critic_trunk.", "critic_head."))]
            params = [(actor, t.lr), (critic, t.critic_lr)]
        opts_scheds = [scheduled_adamw(group, lr, t, eps=1e-5) for group, lr in params]
        self.opts = [opt for opt, _ in opts_scheds]
        self.scheds = [sched for _, sched in opts_scheds]
        self.scaler = ReturnScaler(a.gamma) if cfg.env.normalize_reward else None
        self.gen = torch.Generator().manual_seed(t.seed)

    # ------------------------------------------------------------------------------------------------------------
    def _rewards(self, seg: EnvSegment) -> np.ndarray:
        e = self.cfg.env
        r = seg.rewards.astype(np.float64) * e.reward_scale
        if self.scaler is not None:
            r = self.scaler(seg, r)
        if e.reward_clip is not None:
            r = np.clip(r, -e.reward_clip, e.reward_clip)
        return r

    def _tensor(self, arrays: Sequence[np.ndarray], dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.concatenate(arrays), dtype=dtype, device=self.device)

    @torch.no_grad()
    def prepare(self, segments: Sequence[EnvSegment]) -> dict[str, torch.Tensor]:
        """Flatten the segments, update the observation statistics, compute values, proximal log-probs and GAE."""
        a, pol = self.cfg.algorithm, self.policy
        M, T = sum(s.num_envs for s in segments), segments[0].num_steps
        obs = self._tensor([s.obs for s in segments], torch.float32)  # [M, T, *S]
        flat_obs = obs.reshape(M * T, *obs.shape[2:])
        if pol.obs_norm is not None:
            pol.obs_norm.update(flat_obs.reshape(M * T, -1))
        actions = self._tensor([s.actions for s in segments])
        flat_act = actions.reshape(M * T, *actions.shape[2:])
        values = pol.value(flat_obs).reshape(M, T)
        next_values = torch.cat([values[:, 1:], pol.value(self._tensor([s.bootstrap_obs for s in segments],
                                                                      torch.float32))[:, None]], dim=1)
        finals = [(s.final_index + row * T, s.final_obs) for s, row in
                  zip(segments, np.cumsum([0] + [s.num_envs for s in segments[:-1]])) if s.final_index.size]
        if finals:
            idx = torch.as_tensor(np.concatenate([f[0] for f in finals]), device=self.device)
            fv = pol.value(self._tensor([f[1] for f in finals], torch.float32))
            next_values.view(-1)[idx] = fv
        rewards = self._tensor([self._rewards(s) for s in segments], torch.float32)
        term = self._tensor([s.terminated for s in segments])
        trunc = self._tensor([s.truncated for s in segments])
        adv, ret = transition_gae(rewards, values, next_values, term, trunc, gamma=a.gamma, lambd=a.lambd)
        behav = self._tensor([s.logprobs for s in segments], torch.float32).reshape(-1)
        old = pol.evaluate(flat_obs, flat_act)[0] if a.off_policy_correction == "decoupled" else behav
        flat_adv = adv.reshape(-1)
        if a.whiten_advantages:
            flat_adv = algo.flat_whiten(flat_adv)
        return {"obs": flat_obs, "actions": flat_act, "behav": behav, "old": old.float(), "adv": flat_adv,
                "returns": ret.reshape(-1), "values": values.reshape(-1), "rewards": rewards}

    # ------------------------------------------------------------------------------------------------------------
    def step(self, segments: Sequence[EnvSegment]) -> dict[str, float]:
        a, pol = self.cfg.algorithm, self.policy
        b = self.prepare(segments)
        n = b["obs"].shape[0]
        mb = n // self.cfg.env.num_minibatches
        sums: dict[str, float] = {}
        count = 0
        pol.train()
        for _ in range(a.ppo_epochs):
            perm = torch.randperm(n, generator=self.gen).to(self.device)
            for start in range(0, n - mb + 1, mb):
                idx = perm[start:start + mb]
                m = self._minibatch(b, idx)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        for s in self.scheds:
            advance(s)
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out.update({
            "actor/lr": self.opts[0].param_groups[0]["lr"],
            "actor/optimizer_steps": float(count),
            "actor/advantages_mean": float(b["adv"].mean()),
            "critic/values_mean": float(b["values"].mean()),
            "critic/returns_mean": float(b["returns"].mean()),
            "critic/explained_variance": float(algo.explained_variance(
                b["values"][None], b["returns"][None], torch.ones_like(b["values"][None], dtype=torch.bool))),
            "reward/step_mean": float(b["rewards"].mean()),
        })
        if not self.actor_critic:
            out["critic/lr"] = self.opts[1].param_groups[0]["lr"]
        if pol.obs_norm is not None:
            out["env/obs_norm_count"] = float(pol.obs_norm.count)
        return out

    def _minibatch(self, b: dict, idx: torch.Tensor) -> dict[str, float]:
        a, pol = self.cfg.algorithm, self.policy
        logp, entropy, v = pol.evaluate(b["obs"][idx], b["actions"][idx])
        ones = torch.ones(1, idx.shape[0], dtype=torch.bool, device=self.device)
        pg, pm = algo.policy_loss(
            logp[None], b["old"][idx][None], b["adv"][idx][None], ones, clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high, dual_clip=a.dual_clip_loss, clip_ratio_c=a.clip_ratio_c,
            behavior_logprobs=b["behav"][idx][None], off_policy_correction=a.off_policy_correction,
            off_policy_cap=a.off_policy_cap)
        vl, vm = algo.value_loss(v[None], b["values"][idx][None], b["returns"][idx][None], ones,
                                 value_clip=a.value_clip, huber_delta=a.huber_delta)
        ent = entropy.mean()
        actor_loss = algo.combine_actor_loss(pg, ent, a.entropy_coef)
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        if self.actor_critic:
            (actor_loss + a.vf_coef * vl).backward()
        else:
            actor_loss.backward()
            (a.vf_coef * vl).backward()
        clip = self.cfg.trainer.grad_clip
        norms = [clip_and_step(o, [p for g in o.param_groups for p in g["params"]], clip)[0] for o in self.opts]
        out = {f"actor/{k}": float(v) for k, v in pm.items()}
        out.update({f"critic/{k}": float(x) for k, x in vm.items() if k != "vf_explained_var"})
        out["actor/entropy"] = float(ent.detach())
        out["actor/grad_norm"] = float(norms[0])
        if len(norms) > 1:
            out["critic/grad_norm"] = float(norms[1])
        return out

    def state_dict(self) -> dict:
        return {"opts": [o.state_dict() for o in self.opts], "scheds": [s.state_dict() for s in self.scheds]}

    def resume_state(self) -> dict:
        """What a checkpoint adds to :meth:`state_dict` for an exact continuation: the mini-batch generator and the
        reward scaler's statistics (plain tensors and numbers, so ``torch.load(weights_only=True)`` reads them)."""
        state = dict(self.state_dict(), gen=self.gen.get_state())
        if self.scaler is not None:
            state["reward_rms"] = self.scaler.rms.state_dict()
        return state

    def load_resume_state(self, state: dict) -> None:
        for opt, saved in zip(self.opts, state["opts"]):
            opt.load_state_dict(saved)
        for sched, saved in zip(self.scheds, state["scheds"]):
            sched.load_state_dict(saved)
        self.gen.set_state(state["gen"])
        if self.scaler is not None and "reward_rms" in state:
            self.scaler.rms.load_state_dict(state["reward_rms"])
