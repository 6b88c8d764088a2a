"""The PPO update, top to bottom: one call of :meth:`PPOUpdate.step` consumes one batch and advances the policy.

1. Recompute the proximal policy's log-probs (the learner's weights before this update), the critic's values and the
   reference log-probs (when a KL term is on). A step of one optimizer step over one micro-batch (the schema's
   default; the built-in task's recipe makes 4) takes the first two from its own training forward instead of extra
   no-grad passes. With ``model.shared_backbone`` the values come from the actor's forward through a value head
   (:mod:`asyncppo.learner.value_head`).
2. Shape the outcome rewards (clip, normalise), place them on the last response token, optionally subtract the KL
   penalty per token (KL in reward).
3. Advantages and returns with the configured estimator; whitening and clipping.
4. ``ppo_epochs`` passes over shuffled mini-batches of whole prompt groups; each mini-batch accumulates gradients over
   micro-batches whose losses are normalised by the *mini-batch's* token / sequence counts, so the split does not
   change the gradient; grad clipping; AdamW with linear warm-up. With ``early_stop_kl`` the remaining mini-batches
   of the step are skipped once a mini-batch measures ``approx_kl`` above it (CleanRL's ``target_kl``).

Everything that is a constant of the update and needs more than one micro-batch to compute is computed before the
micro-batch split: the rollout-correction weights and rejection mask (once per batch) and the covariance token
selection of ``clip_cov`` / ``kl_cov`` (once per mini-batch). That is what keeps every loss invariant to the split.
The math lives in :mod:`asyncppo.algo`; this module only wires it to models and optimisers.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from asyncppo import algo
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.learner.batch import TrainBatch, micro_batches, mini_batches
from asyncppo.learner.metric_mean import MetricMean
from asyncppo.learner.schedule import lr_lambda
from asyncppo.learner.forward import chunked, policy_forward, policy_value_forward, response_logits, value_forward
from asyncppo.learner.value_head import shares_actor_body

CRITIC_ESTIMATORS = {"gae"}


def needs_critic(cfg: AsyncPPOConfig) -> bool:
    if cfg.algorithm.use_critic is not None:
        return bool(cfg.algorithm.use_critic)
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS


def needs_reference(cfg: AsyncPPOConfig) -> bool:
    return cfg.algorithm.use_kl_loss or cfg.algorithm.add_token_level_kl


@dataclass
class _FirstPass:
    """The training forward of a single-pass step, run before the batch statistics (see ``_single_pass``)."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    logits: torch.Tensor
    values: Optional[torch.Tensor]


class PPOUpdate:
    def __init__(
        self,
        cfg: AsyncPPOConfig,
        actor: nn.Module,
        critic: Optional[nn.Module],
        reference: Optional[nn.Module],
        device: torch.device,
        world_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.alg = cfg.algorithm
        self.actor, self.critic, self.reference = actor, critic, reference
        self.device = device
        self.world_size = world_size
        self.shared_critic = shares_actor_body(critic)  # values come from the actor's forward (learner/value_head.py)
        # a training forward with active dropout is a sample, not the proximal policy: no single pass then
        self._has_dropout = any(
            isinstance(m, nn.Dropout) and m.p > 0 for model in (actor, critic) if model is not None for m in model.modules()
        )
        t = cfg.trainer
        self.actor_opt = torch.optim.AdamW(
            actor.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay
        )
        schedule = lr_lambda(t.warmup_steps, t.total_steps, t.lr_schedule)
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_opt, schedule)
        self.critic_opt = self.critic_sched = None
        if critic is not None:
            self.critic_opt = torch.optim.AdamW(
                critic.parameters(), lr=t.critic_lr, betas=tuple(t.betas), weight_decay=t.weight_decay
            )
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, schedule)
        kc = self.alg.kl_ctrl
        self.kl_ctrl = algo.get_kl_controller(
            kc.type, init_kl_coef=kc.init_kl_coef, target_kl=kc.target_kl, horizon=kc.kl_horizon
        )
        self.reward_stats = algo.RunningMeanStd() if self.alg.reward_norm == "running" else None
        self.generator = torch.Generator().manual_seed(t.seed)
        self.kl_base = self.alg.kl_penalty.rstrip("+")
        self.last_mini_batch_kl = 0.0  # approx_kl measured by the last mini-batch (all ranks), for early_stop_kl

    # ------------------------------------------------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        alg = self.alg
        batch = batch.to(self.device)
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}

        # 1. proximal log-probs, values, reference log-probs (no grad). A step that makes one optimizer step over
        # one micro-batch takes them from its own training forward instead (see _single_pass).
        rows = max(self.cfg.algorithm.micro_batch_size, 64) if self.cfg.algorithm.micro_batch_size else 256
        single = self._single_pass(batch)
        if single:
            batch = next(mini_batches(batch, alg.ppo_mini_batch_size, self.generator))  # same RNG use as below
        if self.reference is not None:  # before the first pass, whose graph then stays alive until the backward
            batch.ref_logprobs = self._no_grad_rows(
                lambda b: policy_forward(self.reference, b, alg.temperature, False)[0], batch, rows
            )
        first_pass = self._first_pass(batch) if single else None
        self.actor.eval()
        proximal, batch.old_values = self._proximal_and_values(batch, first_pass, rows)
        batch.old_logprobs = batch.behavior_logprobs if alg.off_policy_correction == "none" else proximal
        mask = batch.response_mask
        # KL(behaviour || proximal), estimated on the behaviour policy's own samples (the same as algo.policy_loss reports)
        metrics["actor/mismatch_kl"] = float(
            algo.masked_mean(algo.kl_penalty(batch.behavior_logprobs, proximal, "k3"), mask)
        )
        # rollout correction: constant weights and the rejection-reduced loss mask, once for the whole batch
        batch.loss_mask = mask.bool()
        if alg.off_policy_correction != "none":
            batch.is_weights, batch.loss_mask, rc_metrics = algo.rollout_correction(
                batch.old_logprobs, batch.behavior_logprobs, mask, level=alg.off_policy_level,
                truncation=alg.off_policy_truncation, cap=alg.off_policy_cap, cap_low=alg.off_policy_cap_low,
                normalize=alg.off_policy_normalize, rejection=alg.rejection, rejection_stat=alg.rejection_stat,
                rejection_low=alg.rejection_low, rejection_high=alg.rejection_high,
            )
            metrics.update({f"actor/{k}": float(v) for k, v in rc_metrics.items()})

        # 2. rewards: shape the outcome score, put it on the last valid token, optional KL-in-reward
        scores = batch.scores.clone()
        metrics["reward/mean"] = float(scores.mean())
        metrics["reward/max"] = float(scores.max())
        metrics["reward/min"] = float(scores.min())
        lengths = mask.sum(dim=1).long()
        if alg.overlong_buffer_len > 0:  # DAPO soft over-length punishment, before clipping and normalisation
            penalty = algo.overlong_penalty(
                lengths, self.cfg.rollout.response_length, alg.overlong_buffer_len, alg.overlong_penalty_factor
            )
            scores = scores + penalty.to(scores)
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        if alg.reward_clip is not None:
            scores = scores.clamp(-alg.reward_clip, alg.reward_clip)
        if alg.reward_norm is not None:
            scores = algo.normalize_rewards(
                scores,
                mode=alg.reward_norm,
                group_index=batch.group_index,
                running=self.reward_stats,
                shift_only=alg.reward_shift,
                scale_only=alg.reward_scale,
            )
        token_rewards = algo.scores_to_token_rewards(scores, mask)
        if alg.add_token_level_kl:
            kl_tok = self._reference_kl(batch, rows)
            token_rewards, kl_info = algo.apply_kl_to_rewards(token_rewards, kl_tok, self.kl_ctrl.value, mask)
            metrics["actor/reward_kl"] = float(kl_info["kl"])
            metrics["actor/kl_coef"] = float(kl_info["kl_coef"])
            self.kl_ctrl.update(float(kl_info["kl"]), batch.size)

        # 3. advantages and returns
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
        metrics["response_length/mean"] = float(lengths.float().mean())

        # 4. PPO epochs over mini-batches, gradient accumulation over micro-batches
        means = MetricMean()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        optimizer_steps, stopped = 0, False
        num_groups = int(batch.group_index.max().item()) + 1
        per_mini = alg.ppo_mini_batch_size if alg.ppo_mini_batch_size > 0 else num_groups
        planned = alg.ppo_epochs * -(-num_groups // per_mini)
        if first_pass is not None:
            self._update_mini_batch(self._prepare_mini_batch(batch), means, first_pass)
            optimizer_steps = 1
        for _ in range(alg.ppo_epochs if first_pass is None else 0):
            for mini in mini_batches(batch, alg.ppo_mini_batch_size, self.generator):
                self._update_mini_batch(self._prepare_mini_batch(mini), means)
                optimizer_steps += 1
                # the KL this mini-batch measured before its own step (as CleanRL): identical on every rank
                if alg.early_stop_kl is not None and self.last_mini_batch_kl > alg.early_stop_kl:
                    stopped = True
                    break
            if stopped:
                break
        self.actor_sched.step()
        if self.critic_sched is not None:
            self.critic_sched.step()
        metrics.update(means.result())
        metrics["actor/lr"] = self.actor_opt.param_groups[0]["lr"]
        metrics["actor/optimizer_steps"] = optimizer_steps
        metrics["actor/optimizer_steps_planned"] = planned
        metrics["actor/early_stopped"] = float(stopped)
        metrics["actor/single_pass"] = float(first_pass is not None)
        metrics["time/update_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------------------------------------------------
    def _reference_kl(self, batch: TrainBatch, rows: int) -> torch.Tensor:
        """Per-token KL(current || reference) used in the reward; ``full`` needs both models' logits."""
        if self.kl_base != "full":
            return algo.kl_penalty(batch.old_logprobs, batch.ref_logprobs, self.kl_base)

        def full(b: TrainBatch) -> torch.Tensor:
            logits = response_logits(self.actor, b, self.alg.temperature)
            ref_logits = response_logits(self.reference, b, self.alg.temperature)
            return algo.kl_penalty(None, None, "full", logits=logits, ref_logits=ref_logits)

        return self._no_grad_rows(full, batch, rows)

    def _single_pass(self, batch: TrainBatch) -> bool:
        """True when this step makes exactly one optimizer step over one micro-batch on one rank.

        Then the weights the loss is differentiated at *are* the proximal policy and the critic's old weights, so
        the training forward's own outputs, detached, are the proximal log-probs and old values: the separate
        no-grad forwards (two of the eight forward-equivalents of the default step, docs/benchmarks.md) would
        recompute the same numbers. The result is the same update up to float summation order. Several ranks,
        mini-batches, epochs or micro-batches keep the separate passes: statistics over the whole batch
        (whitening, weight normalisation) are needed before any micro-batch's loss."""
        alg = self.alg
        if self.world_size != 1 or alg.ppo_epochs != 1 or self._has_dropout:
            return False
        num_groups = int(batch.group_index.max().item()) + 1
        if 0 < alg.ppo_mini_batch_size < num_groups:
            return False
        if alg.max_tokens_per_micro_batch > 0:
            return int(batch.attention_mask.sum()) <= alg.max_tokens_per_micro_batch
        return alg.micro_batch_size <= 0 or alg.micro_batch_size >= batch.size

    def _first_pass(self, batch: TrainBatch) -> _FirstPass:
        self.actor.train()
        with_entropy = self.alg.entropy_coef != 0
        if self.shared_critic:
            return _FirstPass(*policy_value_forward(self.actor, self.critic, batch, self.alg.temperature, with_entropy))
        logprobs, entropy, logits = policy_forward(self.actor, batch, self.alg.temperature, with_entropy)
        values = None
        if self.critic is not None:
            self.critic.train()
            values = value_forward(self.critic, batch)
        return _FirstPass(logprobs, entropy, logits, values)

    def _proximal_and_values(
        self, batch: TrainBatch, first_pass: Optional[_FirstPass], rows: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The proximal policy's log-probs and the critic's old values: from the single pass's own forward, from one
        no-grad actor forward (a shared value head reads the same hidden states), or from one of each model."""
        temperature = self.alg.temperature
        if first_pass is not None:
            values = first_pass.values.detach() if first_pass.values is not None else None
            return first_pass.logprobs.detach(), values
        if self.shared_critic:
            def both(b: TrainBatch) -> torch.Tensor:
                logprobs, _, _, values = policy_value_forward(self.actor, self.critic, b, temperature, False)
                return torch.stack([logprobs, values.to(logprobs.dtype)], dim=-1)

            out = self._no_grad_rows(both, batch, rows)
            return out[..., 0], out[..., 1]
        proximal = self._no_grad_rows(lambda b: policy_forward(self.actor, b, temperature, False)[0], batch, rows)
        if self.critic is None:
            return proximal, None
        self.critic.eval()
        return proximal, self._no_grad_rows(lambda b: value_forward(self.critic, b), batch, rows)

    def _no_grad_rows(self, fn, batch: TrainBatch, rows: int) -> torch.Tensor:
        """No-grad forward over every row in chunks; the multi-rank learner splits this work over its ranks."""
        return chunked(fn, batch, rows)

    def _prepare_mini_batch(self, mini: TrainBatch) -> TrainBatch:
        """Per-mini-batch constants computed before the micro-batch split: clip_cov / kl_cov's token selection."""
        alg = self.alg
        mode = algo.COV_LOSSES.get(alg.policy_loss)
        if mode is not None:
            ratio = alg.clip_cov_ratio if mode == "clip" else alg.kl_cov_ratio
            mini.token_select = algo.cov_select(
                mini.advantages, mini.old_logprobs, self._loss_mask(mini), mode, ratio,
                lb=alg.clip_cov_lb, ub=alg.clip_cov_ub, generator=self.generator,
            )
        return mini

    @staticmethod
    def _loss_mask(b: TrainBatch) -> torch.Tensor:
        return b.loss_mask if b.loss_mask is not None else b.response_mask.bool()

    def _all_reduce(self, values: list[float]) -> list[float]:
        counts = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            import torch.distributed as dist

            counts = counts.to(self.device)
            dist.all_reduce(counts)
        return [float(x) for x in counts.cpu()]

    def _global_counts(self, mini: TrainBatch) -> tuple[float, float, float, float]:
        """(tokens, sequences) of the mini-batch for the critic, then for the policy terms (rejected tokens and
        fully rejected sequences left out), summed over the learner ranks."""
        lm = self._loss_mask(mini)
        rejected_rows = float((mini.response_mask.bool().any(-1) & ~lm.any(-1)).sum())
        tokens, seqs, p_tokens, p_seqs = self._all_reduce(
            [float(mini.response_mask.sum()), float(mini.size), float(lm.sum()), float(mini.size) - rejected_rows]
        )
        return tokens, seqs, max(p_tokens, 1.0), max(p_seqs, 1.0)

    def _update_mini_batch(self, mini: TrainBatch, means: MetricMean, first_pass: Optional[_FirstPass] = None) -> None:
        alg = self.alg
        global_tokens, global_seqs, policy_tokens, policy_seqs = self._global_counts(mini)
        # One normalisation per mask: the actor terms (policy, entropy, KL) count the loss mask's tokens (rejected
        # ones left out), the critic the whole response. Losses take it as keywords, aggregate() as mode=.
        counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_length=alg.loss_agg_norm_length)
        agg = dict(loss_agg_mode=alg.loss_agg_mode, **counts)
        actor_counts = dict(global_tokens=policy_tokens, global_seqs=policy_seqs, norm_length=alg.loss_agg_norm_length)
        actor_agg = dict(loss_agg_mode=alg.loss_agg_mode, **actor_counts)
        mat_agg = dict(mode=alg.loss_agg_mode, **actor_counts)
        kl_sum = kl_tokens = 0.0
        # FSDP averages gradients over ranks; the losses are already normalised by global counts, so undo the mean.
        scale = float(self.world_size)
        self.actor_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)
        # Each micro-batch loss is its share of the mini-batch loss (global normalisation): losses are summed here,
        # ratio-type metrics are token-weighted means.
        loss_sums: dict[str, float] = defaultdict(float)
        parts = [mini] if first_pass else micro_batches(mini, alg.micro_batch_size, alg.max_tokens_per_micro_batch)
        for micro in parts:
            weight = float(micro.response_mask.sum())
            values = None
            if first_pass is not None:
                logprobs, entropy, logits, values = (
                    first_pass.logprobs, first_pass.entropy, first_pass.logits, first_pass.values
                )
            elif self.shared_critic:
                logprobs, entropy, logits, values = policy_value_forward(
                    self.actor, self.critic, micro, alg.temperature, with_entropy=alg.entropy_coef != 0
                )
            else:
                logprobs, entropy, logits = policy_forward(
                    self.actor, micro, alg.temperature, with_entropy=alg.entropy_coef != 0
                )
            if entropy is None:  # reported, not optimised: no autograd graph over the vocabulary
                with torch.no_grad():
                    entropy = algo.entropy_from_logits(logits.detach())
            lmask = self._loss_mask(micro)
            pg_loss, pg_metrics = algo.policy_loss(
                logprobs,
                micro.old_logprobs,
                micro.advantages,
                lmask,
                loss_name=alg.policy_loss,
                clip_ratio_low=alg.clip_ratio_low,
                clip_ratio_high=alg.clip_ratio_high,
                dual_clip=alg.dual_clip_loss,
                clip_ratio_c=alg.clip_ratio_c,
                tis_cap=alg.tis_cap,
                kl_cov_coef=alg.kl_cov_coef,
                token_select=micro.token_select,
                is_weights=micro.is_weights,
                **actor_agg,
            )
            n_kept = float(lmask.sum())
            kl_sum += float(pg_metrics["approx_kl"]) * n_kept
            kl_tokens += n_kept
            entropy_term = algo.aggregate(entropy, lmask, **mat_agg)
            loss = pg_loss - alg.entropy_coef * entropy_term
            step_metrics = {f"actor/{k}": v for k, v in pg_metrics.items() if k != "pg_loss"}
            step_metrics["actor/entropy"] = float(algo.masked_mean(entropy.detach(), micro.response_mask))
            loss_sums["actor/pg_loss"] += float(pg_loss.detach())
            if alg.use_kl_loss:
                ref_logits = None
                if self.kl_base == "full":
                    with torch.no_grad():
                        ref_logits = response_logits(self.reference, micro, alg.temperature)
                kl_mat = algo.kl_penalty(
                    logprobs, micro.ref_logprobs, alg.kl_penalty, logits=logits, ref_logits=ref_logits
                )
                kl_loss = algo.aggregate(kl_mat, lmask, **mat_agg)
                loss = loss + alg.kl_loss_coef * kl_loss
                loss_sums["actor/kl_loss"] += float(kl_loss.detach())
            if not self.shared_critic:  # the actor's graph is freed before the critic's forward
                (loss * scale).backward()
            if self.critic is not None:
                if values is None:
                    values = value_forward(self.critic, micro)
                vf_loss, vf_metrics = algo.value_loss(
                    values,
                    micro.old_values,
                    micro.returns,
                    micro.response_mask,
                    value_clip=alg.value_clip,
                    huber_delta=alg.huber_delta,
                    **agg,
                )
                if self.shared_critic:  # one graph: policy and value losses through the shared body at once
                    loss = loss + alg.vf_coef * vf_loss
                else:
                    (alg.vf_coef * vf_loss * scale).backward()
                loss_sums["critic/vf_loss"] += float(vf_loss.detach())
                step_metrics.update({f"critic/{k}": v for k, v in vf_metrics.items() if k != "vf_loss"})
            if self.shared_critic:
                (loss * scale).backward()
            means.add(step_metrics, weight)
        # approx_kl of the whole mini-batch (all ranks): the early-stopping decision must be the same everywhere
        if alg.early_stop_kl is not None:
            kl_sum, kl_tokens = self._all_reduce([kl_sum, kl_tokens])
        self.last_mini_batch_kl = kl_sum / max(kl_tokens, 1.0)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), self.cfg.trainer.grad_clip)
        self.actor_opt.step()
        extra = {"actor/grad_norm": float(grad_norm), **loss_sums}
        if self.critic_opt is not None:
            critic_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.trainer.grad_clip)
            self.critic_opt.step()
            extra["critic/grad_norm"] = float(critic_norm)
        means.add(extra, 1.0)
