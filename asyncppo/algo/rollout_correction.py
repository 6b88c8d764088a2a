"""Rollout correction: importance weights and rejection masks for the gap between the sampling engine and the learner.

The samples come from the *behaviour* policy ``mu`` (the engine's log-probs: an older version, other kernels, maybe
another dtype); the loss is taken around the learner's *proximal* policy ``pi_old`` (its own recomputation, see
``off_policy_correction`` in :mod:`asyncppo.algo.policy_loss`). Per token the mismatch ratio is
``w_t = pi_old(y_t) / mu(y_t) = exp(old_t - behav_t)``. Everything here is a constant of the update (no
gradient): it depends on two log-prob tensors that the update never changes, so it is computed once per batch --
which is what makes the normalisation to mean 1 and the sequence statistics independent of how the batch is later
cut into mini- and micro-batches.

Two different tools, deliberately kept apart:

* **Importance weights** multiply a token's loss. ``level="token"`` uses ``w_t``; ``level="sequence"`` uses the
  sequence ratio ``W = prod_t w_t`` on every token of the sequence (unbiased for sequence-level rewards, much
  higher variance). ``truncation`` decides what an extreme weight becomes: ``clip`` caps it at ``cap`` (TIS),
  ``mask`` zeroes weights above ``cap``, ``icepop`` zeroes weights outside ``[cap_low, cap]`` (two-sided IcePop).
  A zeroed weight keeps the token in the loss's denominator: it is a weight of 0, not a removed token.
* **Rejection** removes tokens (``rejection="token"``) or whole sequences (``"sequence"``) from the *loss mask*
  when a statistic of the ratio leaves ``[low, high]``: they no longer count in token or sequence means either.
  Statistics (samples are drawn from ``mu``, so these estimate KL(mu || pi_old)): ``ratio`` (``w_t``; per
  sequence the product ``W``), ``k1`` (``-log w_t``), ``k2`` (``0.5 log^2 w_t``), ``k3`` (``w_t - 1 - log w_t``);
  per sequence the k-statistics are averaged over the sequence's tokens (``k1`` per sequence is the log of the
  inverse geometric-mean ratio).

``normalize=True`` rescales the final weights to mean 1 over the kept tokens (token level) or kept sequences
(sequence level) of the batch: the correction then changes which tokens matter, not the overall step size.
"""

from __future__ import annotations

from typing import Optional

import torch

from .normalize import masked_mean

__all__ = [
    "IS_LEVELS",
    "IS_TRUNCATIONS",
    "REJECTION_LEVELS",
    "REJECTION_STATS",
    "rollout_correction",
    "ratio_metrics",
]

IS_LEVELS = ("token", "sequence")
IS_TRUNCATIONS = ("clip", "mask", "icepop")
REJECTION_LEVELS = ("none", "token", "sequence")
REJECTION_STATS = ("ratio", "k1", "k2", "k3")
_LOG_CLAMP = 20.0
PERCENTILES = (5, 25, 50, 75, 95)


def _check_choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")


def _token_stat(log_w: torch.Tensor, stat: str) -> torch.Tensor:
    if stat == "ratio":
        return torch.exp(log_w)
    if stat == "k1":
        return -log_w
    if stat == "k2":
        return 0.5 * log_w.square()
    return torch.exp(log_w) - 1.0 - log_w  # k3


def _seq_stat(log_w: torch.Tensor, m: torch.Tensor, stat: str) -> torch.Tensor:
    """[B] sequence statistic: the product ratio, or the per-token mean of a k-statistic."""
    if stat == "ratio":
        return torch.exp((log_w * m).sum(-1).clamp(-_LOG_CLAMP, _LOG_CLAMP))
    return (_token_stat(log_w, stat) * m).sum(-1) / m.sum(-1).clamp(min=1)


def rollout_correction(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    truncation: str = "clip",
    cap: float = 2.0,
    cap_low: float = 0.0,
    normalize: bool = False,
    rejection: str = "none",
    rejection_stat: str = "ratio",
    rejection_low: float = 0.5,
    rejection_high: float = 2.0,
    figures: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(weights, loss_mask, metrics)`` for a batch; ``weights`` ``[B, T]`` are 0 outside ``loss_mask``.

    ``loss_mask`` is ``response_mask`` minus rejected tokens/sequences (bool). Metrics (detached 0-d tensors) are
    taken over the batch's valid tokens: ``is_weight_mean`` / ``is_weight_max`` (final weights over kept
    tokens), ``is_truncated_frac`` (tokens whose weight truncation changed), ``is_masked_frac`` (tokens rejected
    from the loss mask), and :func:`ratio_metrics` of the raw ratio.
    """
    _check_arguments(old_logprobs, behavior_logprobs, response_mask, level=level, truncation=truncation, cap=cap,
                     cap_low=cap_low, rejection=rejection, rejection_stat=rejection_stat,
                     rejection_low=rejection_low, rejection_high=rejection_high)
    valid = response_mask.bool()
    dt = torch.promote_types(old_logprobs.dtype, torch.float32)
    mf = valid.to(dt)
    log_w = (old_logprobs.detach().to(dt) - behavior_logprobs.detach().to(dt)).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    log_w = torch.where(valid, log_w, torch.zeros_like(log_w))

    keep = _rejection_keep(log_w, valid, mf, rejection, rejection_stat, rejection_low, rejection_high)
    if level == "token":
        raw = torch.exp(log_w)
    else:
        raw = torch.exp((log_w * mf).sum(-1).clamp(-_LOG_CLAMP, _LOG_CLAMP)).unsqueeze(-1).expand_as(log_w)
    weights, changed = _truncate(raw, truncation, cap, cap_low)
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    if normalize:
        weights = _to_mean_one(weights, keep, level)
    if not figures:
        return weights, keep, {}

    n_valid = mf.sum().clamp(min=1)
    metrics = {
        "is_weight_mean": masked_mean(weights, keep),
        "is_weight_max": torch.where(keep.any(), torch.where(keep, weights, torch.zeros_like(weights)).max(),
                                     torch.ones((), dtype=dt)),
        "is_truncated_frac": (changed & valid).to(dt).sum() / n_valid,
        "is_masked_frac": (valid & ~keep).to(dt).sum() / n_valid,
    }
    metrics.update(ratio_metrics(log_w, valid))
    return weights, keep, metrics


def _check_arguments(
    old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, response_mask: torch.Tensor, *, level: str,
    truncation: str, cap: float, cap_low: float, rejection: str, rejection_stat: str, rejection_low: float,
    rejection_high: float,
) -> None:
    """Every argument error of :func:`rollout_correction`, named by its config option, before any math."""
    _check_choice("off_policy_level", level, IS_LEVELS)
    _check_choice("off_policy_truncation", truncation, IS_TRUNCATIONS)
    _check_choice("rejection", rejection, REJECTION_LEVELS)
    _check_choice("rejection_stat", rejection_stat, REJECTION_STATS)
    if old_logprobs.shape != response_mask.shape or behavior_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, behavior_logprobs {tuple(behavior_logprobs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must match"
        )
    if cap <= 0:
        raise ValueError(f"off_policy_cap must be > 0, got {cap}")
    if truncation == "icepop" and not 0 <= cap_low < cap:
        raise ValueError(f"icepop needs 0 <= off_policy_cap_low < off_policy_cap, got [{cap_low}, {cap}]")
    if rejection != "none" and not rejection_low < rejection_high:
        raise ValueError(f"rejection bounds need low < high, got [{rejection_low}, {rejection_high}]")


def _rejection_keep(
    log_w: torch.Tensor, valid: torch.Tensor, mf: torch.Tensor, rejection: str, stat: str, low: float, high: float
) -> torch.Tensor:
    """The loss mask after rejection: valid tokens (or whole sequences) whose ratio statistic is in ``[low, high]``."""
    if rejection == "token":
        s = _token_stat(log_w, stat)
        return valid & (s >= low) & (s <= high)
    if rejection == "sequence":
        s = _seq_stat(log_w, mf, stat)
        return valid & ((s >= low) & (s <= high)).unsqueeze(-1)
    return valid


def _truncate(raw: torch.Tensor, truncation: str, cap: float, cap_low: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, changed)``: ``clip`` caps at ``cap``; ``mask`` / ``icepop`` zero what leaves the allowed range."""
    if truncation == "clip":
        return raw.clamp(max=cap), raw > cap
    lo = cap_low if truncation == "icepop" else float("-inf")
    changed = (raw > cap) | (raw < lo)
    return torch.where(changed, torch.zeros_like(raw), raw), changed


def _to_mean_one(weights: torch.Tensor, keep: torch.Tensor, level: str) -> torch.Tensor:
    """Rescale to mean 1 over the kept tokens (token level) or kept sequences (sequence level); all-zero weights
    stay zero."""
    if level == "token":
        denom = masked_mean(weights, keep)
    else:
        has = keep.any(-1)
        seq_w = weights.max(-1).values  # constant over a kept sequence's tokens
        denom = (seq_w * has).sum() / has.sum().clamp(min=1)
    return torch.where(denom > 0, weights / denom.clamp(min=torch.finfo(weights.dtype).tiny), weights)


@torch.no_grad()
def ratio_metrics(log_w: torch.Tensor, mask: torch.Tensor) -> dict:
    """Distribution of the mismatch ratio ``w = exp(log_w)`` over valid tokens: percentiles ``is_ratio_p05`` ..
    ``is_ratio_p95`` (linear interpolation, as ``torch.quantile``), and chi-squared divergences
    ``chi2(pi_old || mu) = E_mu[w^2] - 1`` per token (``is_chi2_token``) and per sequence with ``W = prod w``
    (``is_chi2_seq``). Chi-squared is the variance of the importance weight: it says how many effective samples
    the correction leaves (ESS ~ n / (1 + chi2)); a k3 KL can look small while chi-squared is already large."""
    m = mask.bool()
    dt = torch.promote_types(log_w.dtype, torch.float32)
    lw = torch.where(m, log_w.to(dt), torch.zeros_like(log_w, dtype=dt))
    w = torch.exp(lw)
    out: dict = {}
    flat = w[m]
    if flat.numel():
        q = torch.quantile(flat, torch.tensor([p / 100 for p in PERCENTILES], dtype=dt, device=flat.device))
    else:
        q = torch.ones(len(PERCENTILES), dtype=dt)
    for p, v in zip(PERCENTILES, q):
        out[f"is_ratio_p{p:02d}"] = v
    out["is_chi2_token"] = masked_mean(w.square(), m) - 1.0
    has = m.any(-1)
    seq_log = (lw * m).sum(-1).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    out["is_chi2_seq"] = (torch.exp(2 * seq_log) * has).sum() / has.sum().clamp(min=1) - 1.0
    return out


def apply_weights(per_token: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``per_token * weights`` (weights detached); ``None`` leaves the loss unchanged."""
    if weights is None:
        return per_token
    if weights.shape != per_token.shape:
        raise ValueError(f"is_weights shape {tuple(weights.shape)} != loss shape {tuple(per_token.shape)}")
    return per_token * weights.detach().to(per_token.dtype)
