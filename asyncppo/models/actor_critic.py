"""The MLP actor-critic of embodied runs: one module on the learner and in every env worker.

Why one ``nn.Module`` holds everything a worker needs to act: the weight broadcast ships a ``state_dict``, so
whatever is in it travels with the weights at no extra cost. That includes the running observation statistics
(:class:`RunningObsNorm`, buffers, updated by the learner only): a worker always normalises with the statistics of
the policy version it acts with, and the learner's recomputed (proximal) log-probs use the statistics of the
current version, so the decoupled off-policy correction also covers the drift of the normaliser.

Heads: a categorical distribution for ``Discrete`` action spaces; a diagonal Gaussian with a state-independent,
learned log-std for ``Box`` action spaces (the sampled action is sent unclipped on the wire, and clipped to the
space's bounds only when the environment is stepped, as CleanRL's ``ppo_continuous_action`` does). Trunks: shared
(one MLP, two linear heads: ``model.shared_backbone=true``, trained with ``algorithm.loss_type=actor_critic``) or
separate (an actor MLP and a critic MLP). Orthogonal initialisation with gain sqrt(2) in the trunks, 0.01 on the
policy head and 1 on the value head (Andrychowicz et al. 2021; the CleanRL defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


@dataclass(frozen=True)
class PolicySpec:
    """Everything needed to build the same network on the learner and in every worker."""

    obs_dim: int
    discrete: bool
    action_dim: int  # number of actions (discrete) or action vector size (continuous)
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    shared_backbone: bool = False
    normalize_obs: bool = False
    obs_clip: float = 10.0
    init_log_std: float = 0.0


class RunningObsNorm(nn.Module):
    """Running mean / variance of observations (parallel update, float64), applied as a clipped z-score."""

    def __init__(self, dim: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = float(clip), float(eps)
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.detach().to(torch.float64).reshape(-1, self.mean.shape[0])
        n = x.shape[0]
        if n == 0:
            return
        b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
        tot = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta.square() * self.count * n / tot
        self.mean.copy_(self.mean + delta * n / tot)
        self.var.copy_(m2 / tot)
        self.count.copy_(tot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.to(torch.float64) - self.mean) / torch.sqrt(self.var + self.eps)
        return z.clamp(-self.clip, self.clip).to(x.dtype)


def _mlp(sizes: Sequence[int], activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [_init(nn.Linear(a, b), math.sqrt(2.0)), ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


def _init(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    def __init__(self, spec: PolicySpec):
        super().__init__()
        if spec.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={spec.activation!r}; allowed: {', '.join(ACTIVATIONS)}")
        if not spec.hidden_sizes or min(spec.hidden_sizes) < 1:
            raise ValueError(f"model.hidden_sizes={list(spec.hidden_sizes)} needs at least one layer, sizes >= 1")
        self.spec = spec
        sizes = (spec.obs_dim, *spec.hidden_sizes)
        self.obs_norm = RunningObsNorm(spec.obs_dim, spec.obs_clip) if spec.normalize_obs else None
        if spec.shared_backbone:
            self.trunk = _mlp(sizes, spec.activation)
        else:
            self.actor_trunk = _mlp(sizes, spec.activation)
            self.critic_trunk = _mlp(sizes, spec.activation)
        self.actor_head = _init(nn.Linear(sizes[-1], spec.action_dim), 0.01)
        self.critic_head = _init(nn.Linear(sizes[-1], 1), 1.0)
        if not spec.discrete:
            self.log_std = nn.Parameter(torch.full((spec.action_dim,), float(spec.init_log_std)))

    # ------------------------------------------------------------------------------------------------ pieces
    def _features(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = obs.reshape(obs.shape[0], -1).to(self.actor_head.weight.dtype)
        if self.obs_norm is not None:
            x = self.obs_norm(x)
        if self.spec.shared_backbone:
            h = self.trunk(x)
            return h, h
        return self.actor_trunk(x), self.critic_trunk(x)

    def _dist(self, h: torch.Tensor) -> torch.distributions.Distribution:
        out = self.actor_head(h)
        if self.spec.discrete:
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Normal(out, self.log_std.exp().expand_as(out))

    def _logprob(self, dist, actions: torch.Tensor) -> torch.Tensor:
        if self.spec.discrete:
            return dist.log_prob(actions.long())
        return dist.log_prob(actions.to(dist.mean.dtype)).sum(-1)

    def _entropy(self, dist) -> torch.Tensor:
        return dist.entropy() if self.spec.discrete else dist.entropy().sum(-1)

    # ------------------------------------------------------------------------------------------------ learner
    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logprob, entropy, value)`` of ``actions`` at ``obs`` (flat batch), with gradients."""
        ha, hc = self._features(obs)
        dist = self._dist(ha)
        return self._logprob(dist, actions), self._entropy(dist), self.critic_head(hc).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic_head(self._features(obs)[1]).squeeze(-1)

    # ------------------------------------------------------------------------------------------------ worker
    @torch.no_grad()
    def act(self, obs: np.ndarray, generator: Optional[torch.Generator] = None) -> tuple[np.ndarray, np.ndarray]:
        """Sample one action per row of ``obs``; ``(actions, behaviour log-probs)`` as numpy (int64 / float32)."""
        x = torch.as_tensor(obs, device=self.actor_head.weight.device)
        dist = self._dist(self._features(x)[0])
        if self.spec.discrete:
            probs = dist.probs
            a = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            noise = torch.randn(dist.mean.shape, generator=generator, device=dist.mean.device,
                                dtype=dist.mean.dtype)
            a = dist.mean + dist.stddev * noise
        logp = self._logprob(dist, a)
        a_np = a.cpu().numpy().astype(np.int64 if self.spec.discrete else np.float32)
        return a_np, logp.cpu().numpy().astype(np.float32)
