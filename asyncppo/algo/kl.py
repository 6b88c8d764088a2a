"""Per-token KL estimators between the policy and the reference, and KL-as-reward shaping.

Tokens are sampled from the policy, so with ``d = logp - ref_logp`` (per token):

* ``kl`` / ``k1``: ``d`` -- unbiased, high variance, can be negative.
* ``abs``: ``|d|``.
* ``mse`` / ``k2``: ``0.5 d^2`` -- biased, low variance; its gradient is the true KL gradient.
* ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1`` -- unbiased and non-negative (Schulman's k3);
  ``d`` is clamped to [-20, 20] and the result to at most 10 so a single outlier token cannot
  dominate the loss.
* ``full``: the exact KL over the vocabulary from the two logit tensors ``[B, T, V]``.

A ``+`` suffix (e.g. ``low_var_kl+``) keeps the *value* of the base estimator but the *gradient* of
k2 (straight-through): k1 and k3 used as a loss give a biased or zero-mean gradient of the KL,
while ``grad k2`` is the unbiased one, so this reports the familiar number and trains correctly.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .aggregation import aggregate
from .normalize import masked_mean

__all__ = ["kl_penalty", "KL_ESTIMATORS", "get_kl_estimator", "apply_kl_to_rewards", "kl_loss", "mismatch_kl"]

_K3_LOG_CLAMP = 20.0
_K3_MAX = 10.0


def _k1(logprob, ref_logprob, logits, ref_logits):
    return logprob - ref_logprob


def _abs(logprob, ref_logprob, logits, ref_logits):
    return (logprob - ref_logprob).abs()


def _k2(logprob, ref_logprob, logits, ref_logits):
    return 0.5 * (logprob - ref_logprob).square()


def _k3(logprob, ref_logprob, logits, ref_logits):
    d = (logprob - ref_logprob).clamp(-_K3_LOG_CLAMP, _K3_LOG_CLAMP)
    return (torch.exp(-d) + d - 1.0).clamp(max=_K3_MAX)


def _full(logprob, ref_logprob, logits, ref_logits):
    if logits is None or ref_logits is None:
        raise ValueError("kl_penalty 'full' needs logits and ref_logits ([B, T, V]) to sum over the vocabulary")
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} != ref_logits shape {tuple(ref_logits.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    logq = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(dim=-1)


KL_ESTIMATORS: dict[str, Callable] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
    "full": _full,
}


def get_kl_estimator(kind: str) -> Callable:
    """The estimator function for ``kind`` (a base name, optionally with a ``+`` suffix)."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        allowed = ", ".join(KL_ESTIMATORS)
        raise ValueError(f"unknown kl_penalty {kind!r}; allowed: {allowed}, each optionally with a '+' suffix")
    fn = KL_ESTIMATORS[base]
    if not kind.endswith("+"):
        return fn

    def straight_through(logprob, ref_logprob, logits, ref_logits):
        value = fn(logprob, ref_logprob, logits, ref_logits)
        k2 = _k2(logprob, ref_logprob, None, None)
        return k2 + (value - k2).detach()

    return straight_through


def kl_penalty(
    logprob: Optional[torch.Tensor],
    ref_logprob: Optional[torch.Tensor],
    kind: str = "low_var_kl",
    logits: Optional[torch.Tensor] = None,
    ref_logits: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate ``[B, T]`` (see module docstring for ``kind``).

    ``full`` reads only the logits, so its log-prob arguments may be ``None`` (the KL-in-reward path has no
    sampled log-probs to pass); ``full+`` needs them for its k2 gradient. Every other estimator needs both."""
    fn = get_kl_estimator(kind)
    if kind == "full" and (logprob is None or ref_logprob is None):
        return fn(None, None, logits, ref_logits)
    if logprob is None or ref_logprob is None:
        raise ValueError(
            f"kl_penalty {kind!r} needs logprob and ref_logprob ([B, T]); only 'full' works from logits alone"
        )
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob shape {tuple(logprob.shape)} != ref_logprob shape {tuple(ref_logprob.shape)}")
    return fn(logprob, ref_logprob, logits, ref_logits)


def mismatch_kl(behavior_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(behaviour || proximal) as a masked mean of k3 (a 0-d tensor): how far the engine's samples lag the policy
    the loss is taken around. The tokens were drawn from the behaviour policy, so the behaviour log-probs go first.
    One definition for the learner's batch-level ``actor/mismatch_kl`` and :func:`~asyncppo.algo.policy_loss`'s."""
    return masked_mean(kl_penalty(behavior_logprobs, old_logprobs, "k3"), mask)


def apply_kl_to_rewards(
    token_rewards: torch.Tensor, kl: torch.Tensor, coef: float, mask: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """KL-in-reward: ``r_t - coef * kl_t`` on valid tokens (``add_token_level_kl``).

    Returns the shaped rewards and metrics: ``kl`` is the batch mean of each sequence's mean
    per-token KL (the quantity an adaptive controller tracks, so its target does not depend on
    response length), ``kl_coef`` the coefficient used.
    """
    if not (token_rewards.shape == kl.shape == mask.shape):
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, kl {tuple(kl.shape)} and mask {tuple(mask.shape)} must match"
        )
    m = mask.to(kl.dtype)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl)).detach()
    shaped = token_rewards - coef * kl * m.to(token_rewards.dtype)
    seq_kl = (kl * m).sum(-1) / m.sum(-1).clamp(min=1)
    has = (m.sum(-1) > 0).to(kl.dtype)
    current = (seq_kl * has).sum() / has.sum().clamp(min=1)
    return shaped, {"kl": current, "kl_coef": float(coef)}


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    *,
    logits: Optional[torch.Tensor] = None,
    ref_logits: Optional[torch.Tensor] = None,
    global_tokens=None,
    global_seqs=None,
    norm_length=None,
) -> tuple[torch.Tensor, dict]:
    """KL-as-loss (``use_kl_loss``): the per-token estimate aggregated like the policy loss.

    The caller adds ``kl_loss_coef * loss`` to the actor loss.
    """
    per_token = kl_penalty(logprob, ref_logprob, kind, logits, ref_logits)
    loss = aggregate(
        per_token, mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=norm_length
    )
    return loss, {"kl_loss": loss.detach(), "kl_mean": masked_mean(per_token.detach(), mask)}
