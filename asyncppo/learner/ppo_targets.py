"""What one PPO step aims at, computed once for the whole batch before any mini-batch: the rollout correction, the
shaped rewards and the advantages and returns.

Why these live apart from :mod:`asyncppo.learner.ppo`: they need no model, only the batch's columns (log-probs,
scores, masks, values already computed) and the ``algorithm`` config, so each is a short sequence of
:mod:`asyncppo.algo` calls that can be read, and tested, without a forward pass. Each writes its results onto the
batch's columns and its numbers into ``metrics`` (in the order the step reports them).
"""

from __future__ import annotations

from typing import Optional

import torch

from asyncppo import algo
from asyncppo.config.schema import AlgorithmConfig
from asyncppo.learner.batch import TrainBatch


def correct_rollout(alg: AlgorithmConfig, batch: TrainBatch, proximal: torch.Tensor, metrics: dict) -> None:
    """Set ``old_logprobs`` (the policy the trust region is taken around) and the rollout correction's constant
    ``is_weights`` and rejection-reduced ``loss_mask``: once per batch, so they do not depend on the later split."""
    batch.old_logprobs, weights, batch.loss_mask = proximal_terms(alg, batch, proximal, metrics)
    if weights is not None:
        batch.is_weights = weights
    mask_truncated(alg, batch, metrics)


def proximal_terms(
    alg: AlgorithmConfig, batch: TrainBatch, proximal: torch.Tensor, metrics: Optional[dict]
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(old_logprobs, is_weights or None, keep)`` of these rows given the proximal log-probs: the behaviour
    log-probs or the proximal ones, the correction's weights (None without a correction) and its rejection-reduced
    mask. ``metrics`` (None: not wanted) gets ``actor/mismatch_kl`` and the correction's own figures.

    Every output is per token or per sequence unless ``off_policy_normalize`` or a rejection is on, so without
    those a micro-batch's rows get the same values here as they get inside their whole batch (which is what lets
    the update take the proximal log-probs from each micro-batch's training forward, ``PPOUpdate._fuses_proximal``)."""
    mask = batch.response_mask
    old = batch.behavior_logprobs if alg.off_policy_correction == "none" else proximal
    if metrics is not None:  # estimated on the behaviour policy's own samples, as algo.policy_loss reports it
        metrics["actor/mismatch_kl"] = float(algo.mismatch_kl(batch.behavior_logprobs, proximal, mask))
    if alg.off_policy_correction == "none":
        return old, None, mask.bool()
    weights, keep, rc_metrics = algo.rollout_correction(
        old, batch.behavior_logprobs, mask, level=alg.off_policy_level,
        truncation=alg.off_policy_truncation, cap=alg.off_policy_cap, cap_low=alg.off_policy_cap_low,
        normalize=alg.off_policy_normalize, rejection=alg.rejection, rejection_stat=alg.rejection_stat,
        rejection_low=alg.rejection_low, rejection_high=alg.rejection_high, figures=metrics is not None,
    )
    if metrics is not None:
        metrics.update({f"actor/{k}": float(v) for k, v in rc_metrics.items()})
    return old, weights, keep


def mask_truncated(alg: AlgorithmConfig, batch: TrainBatch, metrics: dict) -> None:
    """Report the share of responses cut at the length limit; with ``mask_truncated`` take them out of the policy
    terms (and their denominators): an unfinished working has no verdict on its own tokens, and on long generations
    its one zero-reward sequence, pushed down token by token, outweighs the finished answers of its group."""
    if batch.loss_mask is None:
        batch.loss_mask = batch.response_mask.bool()
    if batch.truncated is not None:
        metrics["response_length/clip_ratio"] = float(batch.truncated.float().mean())
        if alg.mask_truncated:
            batch.loss_mask = batch.loss_mask & ~batch.truncated[:, None]


def outcome_token_rewards(
    alg: AlgorithmConfig,
    batch: TrainBatch,
    response_length: int,
    running: Optional[algo.RunningMeanStd],
    metrics: dict,
) -> torch.Tensor:
    """Token rewards ``[B, T]`` from the outcome scores: the over-length penalty (before clipping and
    normalisation), clipping, normalisation, then the score on each response's last token. ``running`` is the
    update's reward tracker for ``reward_norm: running`` (updated here)."""
    mask = batch.response_mask
    scores = batch.scores.clone()
    metrics["reward/mean"] = float(scores.mean())
    metrics["reward/max"] = float(scores.max())
    metrics["reward/min"] = float(scores.min())
    if alg.overlong_buffer_len > 0:  # DAPO soft over-length punishment
        lengths = mask.sum(dim=1).long()
        penalty = algo.overlong_penalty(lengths, response_length, alg.overlong_buffer_len, alg.overlong_penalty_factor)
        scores = scores + penalty.to(scores)
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    scores = algo.clip_rewards(scores, alg.reward_clip)
    scores = algo.normalize_rewards(
        scores,
        mode=alg.reward_norm,
        group_index=batch.group_index,
        running=running,
        shift_only=alg.reward_shift,
        scale_only=alg.reward_scale,
    )
    if batch.turn_rewards is not None:  # multi-turn: each turn's reward where the turn ended
        return algo.place_turn_rewards(scores, batch.turn_rewards, mask)
    return algo.scores_to_token_rewards(scores, mask)


def set_advantages(alg: AlgorithmConfig, batch: TrainBatch, token_rewards: torch.Tensor, metrics: dict) -> None:
    """``batch.advantages`` and ``batch.returns`` with the configured estimator (whitening for the estimators that
    are not already group-normalised, then clipping), and the critic's fit to them."""
    mask = batch.response_mask
    advantages, returns = algo.compute_advantages(
        alg.adv_estimator,
        token_rewards,
        mask,
        values=batch.old_values,
        group_index=batch.group_index,
        gamma=alg.gamma,
        lambd=alg.lambd,
        norm_by_std=alg.norm_adv_by_std_in_grpo,
        whiten=alg.whiten_advantages and alg.adv_estimator in ("gae", "reinforce"),
        clip=alg.advantage_clip,
    )
    batch.advantages, batch.returns = advantages, returns
    if batch.old_values is not None:  # NaN (logged as null) when every return is equal: nothing to explain
        metrics["critic/explained_variance"] = float(algo.explained_variance(batch.old_values, returns, mask))
        metrics["critic/values_mean"] = float(algo.masked_mean(batch.old_values, mask))
    metrics["actor/advantages_mean"] = float(algo.masked_mean(advantages, mask))
    metrics["response_length/mean"] = float(mask.sum(dim=1).long().float().mean())
