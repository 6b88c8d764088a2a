"""Advantage and return estimators over token-level rewards ``[B, T]``.

All estimators share one call shape so the learner can pick one by name
(``algorithm.adv_estimator``)::

    advantages, returns = compute_advantages(name, token_rewards, response_mask, values=..., group_index=...)

``token_rewards`` holds the outcome reward on each sample's last valid token (see
:func:`asyncppo.algo.normalize.scores_to_token_rewards`) plus, with KL-in-reward, per-token
penalties. ``response_mask`` marks valid response tokens. Masked positions never influence a result:
the backward recursions *skip* them (a masked token neither bootstraps nor discounts), so a response
with a masked hole (e.g. a tool output inside a multi-turn answer) behaves as if the hole were cut
out. Outputs are 0 at masked positions.

``returns`` is the value-function target: for GAE ``advantages + values``; for every other
estimator the discounted Monte-Carlo return-to-go of ``token_rewards``.

Two epsilons, one per purpose, never shared:

* :data:`GROUP_STD_EPS` (1e-6) is added to a group's *standard deviation* in GRPO's ``(r - mean) / (std + eps)``
  (verl's value). It keeps an all-equal group (std 0) at advantage 0.
* :data:`WHITEN_EPS` (1e-8) is added to the *variance* in whitening ``(x - mean) / sqrt(var + eps)`` (GAE with
  ``whiten_advantages``, REINFORCE++, REINFORCE++-baseline), as in :func:`masked_whiten` and the usual PPO
  convention. Reusing 1e-6 there shrinks low-variance advantages: with var = 2e-6 the scale is off by ~20%.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .normalize import group_mean_std, masked_whiten, scores_to_token_rewards

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8

__all__ = [
    "ADV_ESTIMATORS",
    "get_adv_estimator",
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "discounted_returns",
    "place_turn_rewards",
    "clip_advantages",
    "GROUP_STD_EPS",
    "WHITEN_EPS",
]


def _check(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be [B, T], got shape {tuple(token_rewards.shape)}")
    if response_mask.shape != token_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_rewards shape {tuple(token_rewards.shape)}"
        )
    return response_mask.bool()


def _f(x: torch.Tensor) -> torch.Tensor:
    """At least float32; float64 inputs stay float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{next valid}``, skipping masked tokens; 0 at masked positions."""
    m = _check(token_rewards, response_mask)
    rewards = torch.where(m, token_rewards, _zero(token_rewards))
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        candidate = rewards[:, t] + gamma * running
        running = torch.where(m[:, t], candidate, running)
        out[:, t] = torch.where(m[:, t], candidate, _zero(candidate))
    return out


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, per_sample.unsqueeze(-1).expand(mask.shape), _zero(per_sample))


def _scores(token_rewards: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, token_rewards, _zero(token_rewards)).sum(dim=-1)


def place_turn_rewards(scores: torch.Tensor, turn_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards ``[B, T]`` for a batch with multi-turn samples: each turn reward where its turn ended (the
    ``[B, T]`` ``turn_rewards``, on model tokens), plus whatever the learner's score processing (over-length
    penalty, clipping, normalisation) changed the sample's score by, on its last model token.

    So every row still sums to its processed score ``scores`` (what GRPO/RLOO read), a sample without turn rewards
    gets its score on its last model token as in :func:`scores_to_token_rewards`, and with no processing at all the
    turn rewards stand exactly where the turns ended (what GAE and return-to-go see)."""
    if turn_rewards.shape != response_mask.shape:
        raise ValueError(f"turn_rewards shape {tuple(turn_rewards.shape)} != response_mask shape "
                         f"{tuple(response_mask.shape)}")
    turn_rewards = turn_rewards.to(scores.dtype)
    return scores_to_token_rewards(scores - turn_rewards.sum(dim=-1), response_mask) + turn_rewards


@torch.no_grad()
def gae_advantages(
    token_rewards, response_mask, *, values=None, group_index=None, gamma=1.0, lambd=1.0, norm_by_std=True,
    eps=GROUP_STD_EPS,
):
    """Generalised advantage estimation with bootstrap value 0 after the last valid token.

    Masked tokens inside a response (the environment tokens of a multi-turn episode) are skipped: the recursion
    chains each model token's TD error to the *next model token's* value, never through an environment token."""
    m = _check(token_rewards, response_mask)
    if values is None:
        raise ValueError("adv_estimator 'gae' needs values [B, T] from the critic")
    if values.shape != token_rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != token_rewards shape {tuple(token_rewards.shape)}")
    rewards = _f(torch.where(m, token_rewards, _zero(token_rewards)))
    vals = _f(torch.where(m, values, _zero(values)))
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae = delta + gamma * lambd * last_gae
        valid = m[:, t]
        next_value = torch.where(valid, vals[:, t], next_value)
        last_gae = torch.where(valid, gae, last_gae)
        adv[:, t] = torch.where(valid, gae, torch.zeros_like(gae))
    returns = torch.where(m, adv + vals, torch.zeros_like(adv))
    return adv, returns


@torch.no_grad()
def grpo_advantages(
    token_rewards, response_mask, *, values=None, group_index=None, gamma=1.0, lambd=1.0, norm_by_std=True,
    eps=GROUP_STD_EPS,
):
    """``(score - group mean) / (group std + eps)`` (or without the std when ``norm_by_std`` is off).

    ``score`` is the sum of the sample's token rewards; the std is Bessel-corrected. A singleton
    group has no baseline: its advantage is its raw score.
    """
    m = _check(token_rewards, response_mask)
    scores = _f(_scores(token_rewards, m))
    mean, std, _ = group_mean_std(scores, group_index)
    adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    return _broadcast(adv, m), discounted_returns(_f(token_rewards), response_mask, gamma)


@torch.no_grad()
def rloo_advantages(
    token_rewards, response_mask, *, values=None, group_index=None, gamma=1.0, lambd=1.0, norm_by_std=True,
    eps=GROUP_STD_EPS,
):
    """Leave-one-out baseline: ``score - mean(scores of the other samples in the group)``."""
    m = _check(token_rewards, response_mask)
    scores = _f(_scores(token_rewards, m))
    mean, _, count = group_mean_std(scores, group_index)
    n = count
    # mean is 0 for singleton groups (no baseline), which leaves the raw score.
    others = torch.where(n > 1, (mean * n - scores) / (n - 1).clamp(min=1), torch.zeros_like(scores))
    return _broadcast(scores - others, m), discounted_returns(_f(token_rewards), response_mask, gamma)


@torch.no_grad()
def reinforce_advantages(
    token_rewards, response_mask, *, values=None, group_index=None, gamma=1.0, lambd=1.0, norm_by_std=True,
    eps=GROUP_STD_EPS,
):
    """Plain REINFORCE: the advantage is the discounted return-to-go."""
    returns = discounted_returns(_f(token_rewards), response_mask, gamma)
    return returns.clone(), returns


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards, response_mask, *, values=None, group_index=None, gamma=1.0, lambd=1.0, norm_by_std=True,
    eps=GROUP_STD_EPS,
):
    """REINFORCE++: discounted returns-to-go whitened over the batch's valid tokens."""
    returns = discounted_returns(_f(token_rewards), response_mask, gamma)
    return masked_whiten(returns, response_mask, eps=WHITEN_EPS), returns


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_rewards, response_mask, *, values=None, group_index=None, gamma=1.0, lambd=1.0, norm_by_std=True,
    eps=GROUP_STD_EPS,
):
    """REINFORCE++-baseline: score minus its group mean, broadcast over tokens, whitened over the batch."""
    m = _check(token_rewards, response_mask)
    scores = _f(_scores(token_rewards, m))
    mean, _, _ = group_mean_std(scores, group_index)
    adv = _broadcast(scores - mean, m)
    returns = discounted_returns(_f(token_rewards), response_mask, gamma)
    return masked_whiten(adv, response_mask, eps=WHITEN_EPS), returns


ADV_ESTIMATORS: dict[str, Callable] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce": reinforce_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}

# Estimators that compare samples of one prompt and so cannot run without group_index.
GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline"})


def get_adv_estimator(name: str) -> Callable:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {name!r}; allowed: {', '.join(ADV_ESTIMATORS)}") from None


def clip_advantages(advantages: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """Clamp advantages to ``[-clip, clip]`` (``algorithm.advantage_clip``); ``None`` is a no-op."""
    if clip is None:
        return advantages
    if clip <= 0:
        raise ValueError(f"advantage_clip must be > 0 or None, got {clip}")
    return advantages.clamp(-clip, clip)


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: Optional[torch.Tensor] = None,
    group_index: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    norm_by_std: bool = True,
    eps: float = GROUP_STD_EPS,
    *,
    whiten: bool = False,
    clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name``; returns ``(advantages, returns)``, both float32 (float64 if given) ``[B, T]``, 0 where masked.

    ``whiten`` additionally whitens the advantages over the batch's valid tokens (the usual choice
    for GAE, ``algorithm.whiten_advantages``) with :data:`WHITEN_EPS` on the variance; ``clip`` then clamps
    them (``advantage_clip``). ``eps`` is GRPO's std epsilon (:data:`GROUP_STD_EPS`) and nothing else.
    Neither touches ``returns``. Advantages are computed without autograd.
    """
    fn = get_adv_estimator(name)
    if name in GROUP_ESTIMATORS and group_index is None:
        raise ValueError(f"adv_estimator {name!r} needs group_index (a LongTensor [B] of prompt-group ids)")
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lambd <= 1.0:
        raise ValueError(f"gamma and lambd must lie in [0, 1]; got gamma={gamma}, lambd={lambd}")
    adv, returns = fn(
        token_rewards,
        response_mask,
        values=values,
        group_index=group_index,
        gamma=gamma,
        lambd=lambd,
        norm_by_std=norm_by_std,
        eps=eps,
    )
    if whiten:
        adv = masked_whiten(adv, response_mask, eps=WHITEN_EPS)
    return clip_advantages(adv, clip), returns
