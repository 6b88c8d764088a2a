"""GAE over environment transitions ``[N envs, T steps]``, where episodes end by termination *or* truncation.

The token-level estimator (:func:`asyncppo.algo.advantages.gae_advantages`) bootstraps 0 after a response's last
token, which is right for a language model: the episode is over. An environment segment differs in two ways:

* an episode can be **truncated** (a time limit, or the end of the segment): the state was not terminal, so the
  target must bootstrap from the value of the observation that followed, ``V(s_{t+1})``;
* an episode can be **terminated** (the task ended): the value after it is 0.

With ``next_values[n, t] = V(s_{t+1})`` (the true next observation: the final one on a truncated step, the
bootstrap observation on a segment's last step), ``done = terminated | truncated``::

    delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}          (A_T = 0)
    R_t     = A_t + values_t                                              (the critic's target)

An episode boundary stops the recursion whichever way the episode ended; only termination also zeroes the
bootstrap. Concatenating two segments of one env therefore gives the same advantages as one long segment whose
middle step carries the second segment's first value as ``next_values`` (the tests check this).
"""

from __future__ import annotations

import torch

__all__ = ["transition_gae", "flat_whiten"]


@torch.no_grad()
def transition_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    *,
    gamma: float = 0.99,
    lambd: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``[N, T]`` in at least float32 (float64 kept)."""
    shape = rewards.shape
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, T], got shape {tuple(shape)}")
    for name, t in (("values", values), ("next_values", next_values), ("terminated", terminated),
                    ("truncated", truncated)):
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != rewards shape {tuple(shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lambd <= 1.0):
        raise ValueError(f"gamma={gamma} and lambd={lambd} must be in [0, 1]")
    dt = torch.promote_types(rewards.dtype, torch.float32)
    r, v, nv = rewards.to(dt), values.to(dt), next_values.to(dt)
    term = terminated.bool()
    cont = (~(term | truncated.bool())).to(dt)
    delta = r + gamma * torch.where(term, torch.zeros_like(nv), nv) - v
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * lambd * cont[:, t] * running
        adv[:, t] = running
    return adv, adv + v


def flat_whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over a flat batch of transitions (no mask: every transition is real).

    The convention of CleanRL's PPO, which embodied runs are compared against: the unbiased std with ``eps`` added
    *outside* the square root. :func:`~asyncppo.algo.normalize.masked_whiten` (token advantages) divides by
    ``sqrt(var + eps)`` instead; the two differ only for a near-constant batch, but a comparison run must match.
    """
    return (values - values.mean()) / (values.std() + eps)
