"""The loss of one micro-batch: the :mod:`asyncppo.algo` terms of the actor (policy, entropy, KL) and of the critic,
normalised by the whole mini-batch's counts.

Why the counts come in from outside: a micro-batch's loss must be its *share* of the mini-batch loss, so that the
gradients summed over micro-batches (and ranks) equal one pass over the mini-batch. :class:`LossNorms` holds those
denominators, one pair per mask: the actor's terms count the rollout correction's ``loss_mask`` (rejected tokens
and sequences left out), the critic counts the whole response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from asyncppo import algo
from asyncppo.config.schema import AlgorithmConfig
from asyncppo.learner.batch import TrainBatch


def loss_mask(batch: TrainBatch) -> torch.Tensor:
    """The tokens the actor's terms train on: the rollout correction's mask, or the whole response without one."""
    return batch.loss_mask if batch.loss_mask is not None else batch.response_mask.bool()


@dataclass(frozen=True)
class LossNorms:
    """The aggregation of every loss term of one mini-batch: the mode and the global denominators per mask."""

    mode: str
    tokens: float
    seqs: float
    policy_tokens: float
    policy_seqs: float
    norm_length: Optional[float]

    @classmethod
    def for_mini_batch(cls, alg: AlgorithmConfig, counts: list[float]) -> "LossNorms":
        """From the global ``(tokens, seqs, policy_tokens, policy_seqs)`` of :func:`algo.loss_denominators` summed
        over ranks; a mini-batch whose every token was rejected still divides by at least 1."""
        tokens, seqs, policy_tokens, policy_seqs = counts
        return cls(alg.loss_agg_mode, tokens, seqs, max(policy_tokens, 1.0), max(policy_seqs, 1.0),
                   alg.loss_agg_norm_length)

    def actor_counts(self) -> dict:
        return dict(global_tokens=self.policy_tokens, global_seqs=self.policy_seqs, norm_length=self.norm_length)

    def actor(self) -> dict:
        return dict(loss_agg_mode=self.mode, **self.actor_counts())

    def critic(self) -> dict:
        return dict(loss_agg_mode=self.mode, global_tokens=self.tokens, global_seqs=self.seqs,
                    norm_length=self.norm_length)


@dataclass
class ActorLoss:
    """One micro-batch's actor loss, what it reports (token-weighted means), the summed loss values, and its
    ``approx_kl`` weighted by its kept tokens (the mini-batch's KL for ``early_stop_kl``)."""

    loss: torch.Tensor
    metrics: dict
    loss_sums: dict
    kl_weighted: float
    kept_tokens: float


def actor_loss(
    alg: AlgorithmConfig,
    micro: TrainBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    norms: LossNorms,
) -> ActorLoss:
    """``pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss`` (:func:`algo.combine_actor_loss`), every term
    aggregated with the mini-batch's actor denominators. ``ref_logits`` only for the ``full`` KL loss."""
    lmask = loss_mask(micro)
    pg_loss, pg_metrics = algo.policy_loss(
        logprobs, micro.old_logprobs, micro.advantages, lmask, loss_name=alg.policy_loss,
        clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high, dual_clip=alg.dual_clip_loss,
        clip_ratio_c=alg.clip_ratio_c, tis_cap=alg.tis_cap, kl_cov_coef=alg.kl_cov_coef,
        token_select=micro.token_select, is_weights=micro.is_weights, **norms.actor(),
    )
    kept = float(lmask.sum())
    entropy_term = algo.aggregate(entropy, lmask, norms.mode, **norms.actor_counts())
    metrics = {f"actor/{k}": v for k, v in pg_metrics.items() if k != "pg_loss"}
    metrics["actor/entropy"] = float(algo.masked_mean(entropy.detach(), micro.response_mask))
    loss_sums = {"actor/pg_loss": float(pg_loss.detach())}
    kl_term = None
    if alg.use_kl_loss:
        kl_term, _ = algo.kl_loss(
            logprobs, micro.ref_logprobs, lmask, alg.kl_penalty, logits=logits, ref_logits=ref_logits,
            **norms.actor(),
        )
        loss_sums["actor/kl_loss"] = float(kl_term.detach())
    loss = algo.combine_actor_loss(pg_loss, entropy_term, alg.entropy_coef, kl_term, alg.kl_loss_coef)
    return ActorLoss(loss, metrics, loss_sums, float(pg_metrics["approx_kl"]) * kept, kept)


def critic_loss(
    alg: AlgorithmConfig, micro: TrainBatch, values: torch.Tensor, norms: LossNorms
) -> tuple[torch.Tensor, dict]:
    """The value loss (``vf_coef`` not applied) over the whole response, and its metrics but the loss itself."""
    vf_loss, vf_metrics = algo.value_loss(
        values, micro.old_values, micro.returns, micro.response_mask, value_clip=alg.value_clip,
        huber_delta=alg.huber_delta, **norms.critic(),
    )
    return vf_loss, {f"critic/{k}": v for k, v in vf_metrics.items() if k != "vf_loss"}
