"""The registry of policy losses (``algorithm.policy_loss``): each maps log-ratios and advantages to a per-token loss.

Every function has the signature ``fn(log_ratio, adv, mask, p, select) -> (per_token [B, T], flags)`` where
``log_ratio = logp - old`` carries the gradient, ``adv`` and ``mask`` are constants, ``p`` a :class:`LossParams`,
``select`` an optional bool ``[B, T]`` of tokens picked by :func:`cov_select` (``clip_cov``, ``kl_cov``), and
``flags`` bool tensors for metrics (``clip_low``, ``clip_high``, ``dual``: tokens where that clip is active). The
caller (:func:`asyncppo.algo.policy_loss.policy_loss`) applies importance weights and aggregates, so every loss
here works with every aggregation mode and micro-batch split. Formulas, sources and names in other libraries:
docs/algorithms.md.

Sequence-level losses (``gspo``, ``gmpo``) compute per-row quantities from that row's tokens only, so splitting
rows into micro-batches does not change them; the paper-faithful aggregation for both is ``seq-mean-token-mean``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["POLICY_LOSSES", "COV_LOSSES", "LossParams", "get_policy_loss", "cov_select"]

_SEQ_LOG_CLAMP = 10.0  # GSPO: the sequence log-ratio is clamped before exp (a mean of token log-ratios)


@dataclass(frozen=True)
class LossParams:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: bool = False
    clip_ratio_c: float = 3.0
    tis_cap: float = 2.0  # reinforce_tis: truncation of the stop-gradient ratio
    kl_cov_coef: float = 1.0  # kl_cov: weight of |log ratio| on the selected tokens


def _none(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x, dtype=torch.bool)


def _clipped_surrogate(ratio, adv, p: LossParams):
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    flags = {"clip_low": (adv < 0) & (r < 1.0 - p.clip_low), "clip_high": (adv > 0) & (r > 1.0 + p.clip_high)}
    if p.dual_clip:
        bound = -adv * p.clip_ratio_c
        flags["dual"] = (adv < 0) & (per_token.detach() > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    else:
        flags["dual"] = _none(adv)
    return per_token, flags


def ppo(log_ratio, adv, mask, p: LossParams, select=None):
    """Clipped surrogate ``max(-A r, -A clip(r, 1-low, 1+high))``, optionally dual-clipped at ``-A c`` for A < 0."""
    return _clipped_surrogate(torch.exp(log_ratio), adv, p)


def gspo(log_ratio, adv, mask, p: LossParams, select=None):
    """GSPO (Zheng et al. 2025): the clipped surrogate on the sequence ratio ``s = exp(mean_t log r_t)``.

    Written per token as ``s_t = sg(s) * r_t / sg(r_t)``: the value of every token is ``s`` and the gradient of
    token ``t`` is ``s * grad log pi_t``, so with ``seq-mean-token-mean`` the sequence gets ``s * mean_t grad``."""
    m = mask.to(log_ratio.dtype)
    seq = (log_ratio.detach() * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = (log_ratio - log_ratio.detach() + seq.unsqueeze(-1)).clamp(max=_SEQ_LOG_CLAMP)
    return _clipped_surrogate(torch.exp(log_s), adv, p)


def gmpo(log_ratio, adv, mask, p: LossParams, select=None):
    """GMPO (Zhao et al. 2025): PPO on the geometric mean of token ratios, clipped token-wise in log space.

    Per sequence ``-A_seq * exp(mean_t sgn(A) min(sgn(A) l_t, sgn(A) clip(l_t, -low, high)))`` with
    ``l_t = log r_t`` and ``A_seq`` the sequence's mean advantage; the value is spread over the sequence's
    tokens (equal on each), so ``seq-mean-token-mean`` gives the mean over sequences. Note the bounds are on the
    *log* ratio (GMPO uses ``(-0.4, 0.4)``)."""
    m = mask.to(log_ratio.dtype)
    n = m.sum(-1).clamp(min=1)
    sgn = torch.sign(adv)
    clamped = log_ratio.clamp(-p.clip_low, p.clip_high)
    pessimistic = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    seq_ratio = torch.exp(((pessimistic * m).sum(-1) / n).clamp(-_SEQ_LOG_CLAMP, _SEQ_LOG_CLAMP))
    seq_adv = (adv * m).sum(-1) / n
    per_seq = -seq_adv * seq_ratio
    lr = log_ratio.detach()
    flags = {"clip_low": (sgn < 0) & (lr < -p.clip_low), "clip_high": (sgn > 0) & (lr > p.clip_high),
             "dual": _none(adv)}
    return per_seq.unsqueeze(-1).expand_as(log_ratio), flags


def _stop_gradient_weighted(log_ratio, adv, weight):
    """``-A * sg(weight / r) * r``: value ``-A * weight``, gradient ``-A * weight * grad log pi``."""
    ratio = torch.exp(log_ratio)
    return -adv * (weight / ratio.detach()).detach() * ratio


def cispo(log_ratio, adv, mask, p: LossParams, select=None):
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, stop-gradient ratio ``sg(clip(r, 1-low,
    1+high))``. Unlike PPO, a clipped token keeps its gradient (scaled by the clipped weight)."""
    r = torch.exp(log_ratio.detach())
    w = r.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    flags = {"clip_low": r < 1.0 - p.clip_low, "clip_high": r > 1.0 + p.clip_high, "dual": _none(adv)}
    return _stop_gradient_weighted(log_ratio, adv, w), flags


def reinforce_tis(log_ratio, adv, mask, p: LossParams, select=None):
    """REINFORCE with a truncated, stop-gradient importance ratio ``sg(min(r, tis_cap))`` (PipelineRL's default):
    no trust region at all, only the weight of a token that became much likelier is capped."""
    r = torch.exp(log_ratio.detach())
    flags = {"clip_low": _none(adv), "clip_high": r > p.tis_cap, "dual": _none(adv)}
    return _stop_gradient_weighted(log_ratio, adv, r.clamp(max=p.tis_cap)), flags


def clip_cov(log_ratio, adv, mask, p: LossParams, select=None):
    """Clip-Cov (Cui et al. 2025): the PPO loss with the selected high-covariance tokens removed (loss and
    gradient 0), which keeps entropy from collapsing. Selection: :func:`cov_select` with ``mode="clip"``."""
    per_token, flags = _clipped_surrogate(torch.exp(log_ratio), adv, p)
    if select is not None:
        per_token = torch.where(select, torch.zeros_like(per_token), per_token)
        flags["cov"] = select
    return per_token, flags


def kl_cov(log_ratio, adv, mask, p: LossParams, select=None):
    """KL-Cov (Cui et al. 2025): the *unclipped* surrogate ``-A r`` everywhere, plus ``kl_cov_coef * |log r|``
    on the selected top-covariance tokens. Selection: :func:`cov_select` with ``mode="kl"``."""
    ratio = torch.exp(log_ratio)
    per_token = -adv * ratio
    flags = {"clip_low": _none(adv), "clip_high": _none(adv), "dual": _none(adv)}
    if select is not None:
        per_token = torch.where(select, per_token + p.kl_cov_coef * log_ratio.abs(), per_token)
        flags["cov"] = select
    return per_token, flags


POLICY_LOSSES: dict[str, Callable] = {
    "ppo": ppo,
    "gspo": gspo,
    "cispo": cispo,
    "gmpo": gmpo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "reinforce_tis": reinforce_tis,
}
# Losses that need cov_select's token selection before the update (and which kind).
COV_LOSSES = {"clip_cov": "clip", "kl_cov": "kl"}


def get_policy_loss(name: str) -> Callable:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy_loss {name!r}; allowed: {', '.join(POLICY_LOSSES)}") from None


@torch.no_grad()
def cov_select(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    ratio: float,
    *,
    lb: float = 1.0,
    ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Tokens whose centred covariance ``(A - mean A)(logp - mean logp)`` drives entropy down (Cui et al. 2025).

    ``mode="clip"``: ``max(1, int(ratio * n))`` tokens drawn at random (``generator``) among those with covariance
    in ``(lb, ub)``; ``mode="kl"``: the ``max(1, int(ratio * n))`` tokens of largest covariance. ``n`` counts valid
    tokens and the means run over them. The learner calls this once per *mini-batch*, with the proximal
    log-probs, so the choice does not depend on how the mini-batch is split into micro-batches (verl selects per
    micro-batch with the current log-probs; at the first mini-batch of an on-policy step the two are equal)."""
    if mode not in ("clip", "kl"):
        raise ValueError(f"cov_select mode must be 'clip' or 'kl', got {mode!r}")
    if not 0 < ratio <= 1:
        raise ValueError(f"covariance selection ratio must be in (0, 1], got {ratio}")
    m = mask.bool()
    dt = torch.promote_types(logprobs.dtype, torch.float32)
    a, lp = advantages.to(dt), logprobs.to(dt)
    n = int(m.sum())
    out = torch.zeros_like(m)
    if n == 0:
        return out
    cov = (a - a[m].mean()) * (lp - lp[m].mean())
    k = max(1, int(ratio * n))
    idx = torch.nonzero(m, as_tuple=False)
    vals = cov[m]
    if mode == "kl":
        chosen = idx[torch.topk(vals, min(k, n)).indices]
    else:
        cand = idx[(vals > lb) & (vals < ub)]
        if cand.shape[0] == 0:
            return out
        perm = torch.randperm(cand.shape[0], generator=generator)[: min(k, cand.shape[0])].to(cand.device)
        chosen = cand[perm]
    out[chosen[:, 0], chosen[:, 1]] = True
    return out
