"""The policy-loss entry point: a loss from the registry (:mod:`asyncppo.algo.policy_loss_registry`, default ``ppo``),
importance weights for stale samples, aggregation and metrics.

With ``r = exp(logp - old_logp)`` and advantage ``A`` the per-token loss is

    L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))          (asymmetric clip, "clip-higher")
    L = min(L, -A c)   for A < 0 when dual_clip (c > 1)          (Ye et al., 2020)

The dual clip bounds the loss of a negative-advantage token whose ratio has exploded; without it a
single very stale token can dominate the update.

Off-policy corrections for asynchronous training, where the sampling (behaviour) policy lags the
learner:

* ``none``: ``old_logprobs`` *are* the behaviour log-probs; standard PPO.
* ``decoupled`` (Hilton et al. 2021; AReaL): ``old_logprobs`` are those of a *proximal* policy,
  recomputed by the learner before the update. The trust region is taken around the proximal
  policy (clip ``pi / pi_prox``) and each token's loss is weighted by the stop-gradient behaviour
  correction ``min(pi_prox / pi_behav, cap)``.
* ``tis`` (truncated importance sampling, Yao et al. 2025): ``old_logprobs`` are the learner's
  recomputation of the sampling policy, ``behavior_logprobs`` the engine's own log-probs; the loss
  is weighted by ``min(exp(old - behav), cap)`` to correct the engine/learner numerical mismatch.

The two off-policy modes share the same weight formula -- they differ in what the caller passes as
``old_logprobs`` -- and both treat the weight as a constant (no gradient). The weights themselves (token or
sequence level, truncation, IcePop, rejection, normalisation) come from
:func:`asyncppo.algo.rollout_correction.rollout_correction`; the learner computes them once per batch and passes
``is_weights`` (and the rejection-reduced ``response_mask``), while a caller with ``behavior_logprobs`` gets the
token-level weights computed here.
"""

from __future__ import annotations

from typing import Optional

import torch

from .aggregation import aggregate
from .kl import kl_penalty, mismatch_kl
from .normalize import masked_mean
from .policy_loss_registry import COV_LOSSES, LossParams, get_policy_loss
from .rollout_correction import apply_weights, rollout_correction

__all__ = ["policy_loss", "OFF_POLICY_CORRECTIONS", "OFF_POLICY_TRUNCATIONS", "combine_actor_loss"]

OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis")
OFF_POLICY_TRUNCATIONS = ("clip", "mask", "icepop")
_LOG_RATIO_CLAMP = 20.0


def _masked_extreme(x: torch.Tensor, m: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max/min over valid entries (1.0 when there are none); no host sync."""
    fill = torch.full((), float("-inf") if largest else float("inf"), dtype=x.dtype, device=x.device)
    v = torch.where(m, x, fill)
    v = v.max() if largest else v.min()
    return torch.where(m.any(), v, torch.ones_like(v))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_name: str = "ppo",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: Optional[float] = None,
    dual_clip: bool = False,
    clip_ratio_c: float = 3.0,
    tis_cap: float = 2.0,
    kl_cov_coef: float = 1.0,
    token_select: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    behavior_logprobs: Optional[torch.Tensor] = None,
    off_policy_correction: str = "none",
    off_policy_cap: float = 2.0,
    off_policy_truncation: str = "clip",
    off_policy_cap_low: float = 0.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_length: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """Policy loss ``loss_name``; returns ``(loss, metrics)`` with metrics as detached 0-d tensors.

    ``clip_ratio_high=None`` uses ``clip_ratio_low``. Gradients flow only through ``logprobs``. ``token_select``
    is the :func:`~asyncppo.algo.policy_loss_registry.cov_select` choice for ``clip_cov`` / ``kl_cov`` (without it they
    reduce to plain PPO / the unclipped surrogate). Importance weights: either ``is_weights`` (precomputed, used
    as constants) or, with ``off_policy_correction != "none"``, token-level weights from ``behavior_logprobs``.
    Metrics are local masked means over this batch: ``approx_kl`` (k3 estimate of KL(old || new)), ``clipfrac``
    (= ``clipfrac_low`` + ``clipfrac_high``: tokens whose clip was active), ``clipfrac_dual``, ``cov_frac``
    (covariance losses), ``ratio_mean/max/min``, ``pg_loss``; with ``behavior_logprobs`` also
    ``is_weight_mean``, ``is_weight_max``, ``is_truncated_frac`` and ``mismatch_kl`` (k3 estimate of
    KL(behaviour || old) -- how far the samples lag the proximal policy).
    """
    fn = get_policy_loss(loss_name)
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    _check_arguments(
        logprobs, dict(old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask,
                       token_select=token_select),
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, dual_clip=dual_clip, clip_ratio_c=clip_ratio_c,
        tis_cap=tis_cap, off_policy_correction=off_policy_correction, off_policy_truncation=off_policy_truncation,
    )
    if off_policy_correction != "none" and is_weights is None:
        _check_behaviour(logprobs, behavior_logprobs, off_policy_correction, off_policy_cap)

    m = response_mask.bool()
    # At least float32 (bf16 ratios are too coarse to clip at 0.2), float64 kept when given.
    dt = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.to(dt)
    old = old_logprobs.detach().to(dt)
    adv = torch.where(m, advantages.detach().to(dt), torch.zeros((), dtype=dt, device=logp.device))
    log_ratio = torch.where(m, (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), torch.zeros_like(logp))

    params = LossParams(clip_low=clip_ratio_low, clip_high=clip_ratio_high, dual_clip=dual_clip,
                        clip_ratio_c=clip_ratio_c, tis_cap=tis_cap, kl_cov_coef=kl_cov_coef)
    select = token_select.bool() & m if token_select is not None and loss_name in COV_LOSSES else None
    per_token, flags = fn(log_ratio, adv, m, params, select)

    metrics: dict = {}
    if is_weights is not None:
        per_token = apply_weights(per_token, is_weights)
    elif off_policy_correction != "none":
        behav = behavior_logprobs.detach().to(dt)
        weights, _, w_metrics = rollout_correction(
            old, behav, m, truncation=off_policy_truncation, cap=off_policy_cap, cap_low=off_policy_cap_low
        )
        per_token = apply_weights(per_token, weights)
        for key in ("is_weight_mean", "is_weight_max", "is_truncated_frac"):
            metrics[key] = w_metrics[key]
        metrics["mismatch_kl"] = mismatch_kl(behav, old, m)

    loss = aggregate(
        per_token, m, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=norm_length
    )
    metrics.update(_surrogate_metrics(loss, old, logp, log_ratio, flags, m))
    return loss, metrics


def _check_arguments(
    logprobs: torch.Tensor, same_shape: dict, *, clip_ratio_low: float, clip_ratio_high: float, dual_clip: bool,
    clip_ratio_c: float, tis_cap: float, off_policy_correction: str, off_policy_truncation: str,
) -> None:
    """Every argument error of :func:`policy_loss` raised before any math, so a bad config fails on its first batch
    with the option's name rather than deep inside a loss. ``same_shape``: tensors that must match ``logprobs``
    (``None`` entries are optional and skipped)."""
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0; got low={clip_ratio_low}, high={clip_ratio_high}")
    if dual_clip and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    if tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"unknown off_policy_correction {off_policy_correction!r}; allowed: {', '.join(OFF_POLICY_CORRECTIONS)}"
        )
    if off_policy_truncation not in OFF_POLICY_TRUNCATIONS:
        raise ValueError(
            f"unknown off_policy_truncation {off_policy_truncation!r}; allowed: {', '.join(OFF_POLICY_TRUNCATIONS)}"
        )
    for name, t in same_shape.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")


def _check_behaviour(
    logprobs: torch.Tensor, behavior_logprobs: Optional[torch.Tensor], correction: str, cap: float
) -> None:
    """The token-level correction computed inside :func:`policy_loss` needs the engine's log-probs and a cap."""
    if behavior_logprobs is None:
        raise ValueError(f"off_policy_correction {correction!r} needs behavior_logprobs")
    if behavior_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"behavior_logprobs shape {tuple(behavior_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    if cap <= 0:
        raise ValueError(f"off_policy_cap must be > 0, got {cap}")


@torch.no_grad()
def _surrogate_metrics(
    loss: torch.Tensor, old: torch.Tensor, logp: torch.Tensor, log_ratio: torch.Tensor, flags: dict, m: torch.Tensor
) -> dict:
    """The loss's own diagnostics as local masked means: how far the policy moved (``approx_kl``, ratio range) and
    how often each clip was active (``clipfrac`` = low + high)."""
    dt = logp.dtype
    r = torch.exp(log_ratio.detach())
    low, high = flags["clip_low"], flags["clip_high"]
    metrics = {
        "pg_loss": loss.detach(),
        "approx_kl": masked_mean(kl_penalty(old, logp.detach(), "k3"), m),
        "clipfrac": masked_mean((low | high).to(dt), m),
        "clipfrac_low": masked_mean(low.to(dt), m),
        "clipfrac_high": masked_mean(high.to(dt), m),
        "clipfrac_dual": masked_mean(flags["dual"].to(dt), m),
        "ratio_mean": masked_mean(r, m),
        "ratio_max": _masked_extreme(r, m, largest=True),
        "ratio_min": _masked_extreme(r, m, largest=False),
    }
    if "cov" in flags:
        metrics["cov_frac"] = masked_mean(flags["cov"].to(dt), m)
    return metrics


def combine_actor_loss(
    pg_loss: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    kl_loss: Optional[torch.Tensor] = None,
    kl_loss_coef: float = 0.0,
) -> torch.Tensor:
    """``pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss``.

    ``entropy`` and ``kl_loss`` must already be aggregated with the same mode and global counts as
    ``pg_loss`` so that the sum stays invariant to micro-batch splitting. A zero coefficient skips
    the term entirely (no graph through the entropy when it is unused).
    """
    total = pg_loss
    if entropy is not None and entropy_coef != 0.0:
        total = total - entropy_coef * entropy
    if kl_loss is not None and kl_loss_coef != 0.0:
        total = total + kl_loss_coef * kl_loss
    return total
