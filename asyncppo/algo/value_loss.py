"""Critic loss (PPO2-style value clipping, squared or Huber error) and explained variance.

Value clipping keeps the new prediction within ``value_clip`` of the prediction made when the batch
was collected and takes the *larger* of the clipped and unclipped errors, so the clip can only slow
the critic down, never reward it for moving past the trust region. Huber error (``huber_delta``)
caps the gradient of outliers, useful when returns have heavy tails.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .aggregation import aggregate
from .normalize import masked_mean, masked_var

__all__ = ["value_loss", "explained_variance", "EV_CONSTANT_TOL"]


def _error(pred: torch.Tensor, target: torch.Tensor, huber_delta: Optional[float]) -> torch.Tensor:
    if huber_delta is None:
        return 0.5 * (pred - target).square()
    # F.huber_loss is 0.5 e^2 for |e| <= delta and delta (|e| - delta / 2) beyond.
    return F.huber_loss(pred, target, reduction="none", delta=huber_delta)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    value_clip: Optional[float] = None,
    huber_delta: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_length: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """Per-token ``0.5 (v - R)^2`` (or Huber), clipped around ``old_values`` when ``value_clip`` is set.

    Returns ``(loss, metrics)``: ``vf_loss``, ``vf_clipfrac`` (tokens where the clipped error won),
    ``vpred_mean``, ``vf_explained_var``. The caller multiplies by ``vf_coef``.
    """
    for name, t in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != values shape {tuple(values.shape)}")
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
    if huber_delta is not None and huber_delta <= 0:
        raise ValueError(f"huber_delta must be > 0 or None, got {huber_delta}")
    m = response_mask.bool()
    dt = torch.promote_types(values.dtype, torch.float32)
    v = values.to(dt)
    target = returns.detach().to(dt)
    err = _error(v, target, huber_delta)
    if value_clip is not None:
        old = old_values.detach().to(dt)
        v_clipped = old + (v - old).clamp(-value_clip, value_clip)
        err_clipped = _error(v_clipped, target, huber_delta)
        per_token = torch.maximum(err, err_clipped)
        clipfrac = masked_mean((err_clipped > err).float(), m)
    else:
        per_token = err
        clipfrac = torch.zeros((), device=v.device)
    loss = aggregate(
        per_token, m, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=norm_length
    )
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": clipfrac.detach(),
        "vpred_mean": masked_mean(v.detach(), m),
        "vf_explained_var": explained_variance(v.detach(), target, m),
    }
    return loss, metrics


#: Returns whose variance is at most this fraction of their scale (``max(1, mean R^2)``) count as constant.
EV_CONSTANT_TOL = 1e-8


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over valid tokens: 1 is a perfect critic, 0 no better than a constant.

    When the returns are constant (every reward in the batch equal) there is nothing to explain and the ratio is
    undefined: NaN is returned (logged as null / left out of means), never a number. "Constant" includes the
    rounding noise of a float32 mean: ``Var[R] <= EV_CONSTANT_TOL * max(1, E[R^2])``. Dividing by that noise was
    what printed -1.6e15; an additive epsilon as in verl only turns it into another large, meaningless number.
    """
    dt = torch.promote_types(values.dtype, torch.float32)
    values = values.to(dt)
    returns = returns.to(dt)
    var_r = masked_var(returns, mask)
    scale = masked_mean(returns.square(), mask).clamp(min=1.0)
    defined = var_r > EV_CONSTANT_TOL * scale
    ev = 1.0 - masked_var(returns - values, mask) / var_r.clamp(min=torch.finfo(dt).tiny)
    return torch.where(defined, ev, torch.full_like(ev, float("nan")))
