"""The PPO update, top to bottom: one call of :meth:`PPOUpdate.step` consumes one batch and advances the policy.

1. Recompute the proximal policy's log-probs (the learner's weights before this update), the critic's values and the
   reference log-probs (when a KL term is on). A step of one optimizer step over one micro-batch (the schema's
   default; the built-in task's recipe makes 4) takes the first two from its own training forward instead of extra
   no-grad passes; one optimizer step over several micro-batches takes the proximal log-probs from each
   micro-batch's training forward (:mod:`asyncppo.learner.passes`). With ``model.shared_backbone`` the values come
   from the actor's forward through a value head (:mod:`asyncppo.learner.value_head`).
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
The math lives in :mod:`asyncppo.algo`, called, never re-derived here. Steps 2-3 and the rollout correction need no
model and live in :mod:`asyncppo.learner.ppo_targets`; the loss terms of one micro-batch in
:mod:`asyncppo.learner.ppo_losses`. This module runs the forwards, the backwards and the optimisers.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from asyncppo import algo
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.learner.batch import TrainBatch, micro_batch_rows, mini_batches
from asyncppo.learner.forward import (
    chunked, forward_footprint, logits_token_budget, policy_forward, policy_value_forward, record_routing,
    response_logits, value_forward,
)
from asyncppo.learner.metric_mean import MetricMean
from asyncppo.learner.packing import pack_capacity, pad_fraction, uses_varlen_attention
from asyncppo.learner.passes import fuses_proximal, single_pass, trained_rows
from asyncppo.learner.optim_step import clip_and_step
from asyncppo.learner.ppo_losses import LossNorms, actor_loss, critic_loss, loss_mask
from asyncppo.learner.ppo_targets import (
    correct_rollout, mask_truncated, outcome_token_rewards, proximal_terms, set_advantages,
)
from asyncppo.learner.schedule import advance, scheduled_adamw
from asyncppo.learner.value_head import shares_actor_body
from asyncppo.models.moe_routing import hooks_of

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
        self.no_grad_tokens = logits_token_budget(actor)  # no-grad forwards: bounded logits, whatever the row count
        self.world_size = world_size
        self.shared_critic = shares_actor_body(critic)  # values come from the actor's forward (learner/value_head.py)
        # a training forward with active dropout is a sample, not the proximal policy: no single pass then
        self._has_dropout = any(
            isinstance(m, nn.Dropout) and m.p > 0 for model in (actor, critic) if model is not None for m in model.modules()
        )
        t = cfg.trainer
        trainable = [p for p in actor.parameters() if p.requires_grad]  # a LoRA actor: its adapters (no base moments)
        self.actor_opt, self.actor_sched = scheduled_adamw(trainable, t.lr, t)
        self.critic_opt, self.critic_sched = (None, None) if critic is None else scheduled_adamw(
            critic.parameters(), t.critic_lr, t)
        kc = self.alg.kl_ctrl
        self.kl_ctrl = algo.get_kl_controller(
            kc.type, init_kl_coef=kc.init_kl_coef, target_kl=kc.target_kl, horizon=kc.kl_horizon
        )
        self.reward_stats = algo.RunningMeanStd() if self.alg.reward_norm == "running" else None
        self.generator = torch.Generator().manual_seed(t.seed)
        self.kl_base = self.alg.kl_penalty.rstrip("+")
        self.last_mini_batch_kl = 0.0  # approx_kl measured by the last mini-batch (all ranks), for early_stop_kl
        self._footprints: list[tuple[int, int]] = []  # (slots, real tokens) of this step's training forwards

    # ------------------------------------------------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy version: the batch's targets (steps 1-3 of the module docstring), then the PPO epochs."""
        batch = batch.to(self.device)
        batch.pack_capacity = pack_capacity(self.alg, uses_varlen_attention(self.actor))
        self._footprints = []
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        rows = max(self.alg.micro_batch_size, 64) if self.alg.micro_batch_size else 256
        routing = hooks_of(self.actor)  # MoE routing replay (models/moe_routing.py, docs/moe.md)
        learner_replay = routing is not None and self.alg.routing_replay == "learner"
        if learner_replay:  # the proximal policy's own routing, replayed by the update's forwards
            # (not when the training forward gives the proximal log-probs itself: it is then that very forward)
            if not (self._single_pass(batch) or self._fuses_proximal(batch)):
                batch.routed_experts = record_routing(self.actor, batch, rows, self.no_grad_tokens)
        elif routing is not None:  # count disagreement with the engine at the step's starting weights
            self._paired_replay_kl(routing, batch, rows, metrics)
            routing.counting = True
        batch, first_pass, fused = self._prepare(batch, rows, metrics)
        if routing is not None:
            # a fused step's proximal log-probs come from its training forwards; the learner mode counts how far
            # the update's own routing moves from the recorded one
            routing.counting = fused or (learner_replay and batch.routed_experts is not None)
        token_rewards = outcome_token_rewards(
            self.alg, batch, self.cfg.rollout.response_length, self.reward_stats, metrics
        )
        if self.alg.add_token_level_kl:
            token_rewards = self._kl_in_reward(batch, token_rewards, rows, metrics)
        set_advantages(self.alg, batch, token_rewards, metrics)
        trained = None if first_pass is not None else trained_rows(batch, self.critic is not None, self.world_size)
        metrics["actor/untrained_rows"] = 0.0 if trained is None else float(batch.size - trained.numel())
        self._train(batch, first_pass, fused, metrics)
        if routing is not None:
            routing.counting = False
            metrics.update(routing.take_metrics())
        metrics["time/update_s"] = time.perf_counter() - t0
        metrics["perf/pad_fraction"] = pad_fraction(self._footprints)
        return metrics

    def _paired_replay_kl(self, routing, batch: TrainBatch, rows: int, metrics: dict) -> None:
        """``algorithm.routing_replay=measure``: the behaviour -> learner KL of this very batch at the step's
        starting weights, once with the learner's own routing and once with the engine's experts replayed
        (``moe/mismatch_kl_own``, ``moe/mismatch_kl_replay``): what replay would change, free of the run's path. One
        extra no-grad forward a step; the update itself routes as the learner does."""
        if routing.apply or batch.routed_experts is None:
            return
        fwd = lambda b: policy_forward(self.actor, b, self.alg.temperature, False)[0]  # noqa: E731
        self.actor.eval()
        own = self._no_grad_rows(fwd, batch, rows)
        routing.apply = True
        try:
            replayed = self._no_grad_rows(fwd, batch, rows)
        finally:
            routing.apply = False
        for name, logprobs in (("own", own), ("replay", replayed)):
            metrics[f"moe/mismatch_kl_{name}"] = float(algo.mismatch_kl(batch.behavior_logprobs, logprobs,
                                                                        batch.response_mask))

    def _prepare(
        self, batch: TrainBatch, rows: int, metrics: dict
    ) -> tuple[TrainBatch, Optional[_FirstPass], bool]:
        """Proximal log-probs, old values and reference log-probs (no grad), then the rollout correction. A step
        that makes one optimizer step over one micro-batch takes the first two from its own training forward
        instead (see :meth:`_single_pass`), and trains on the one mini-batch it draws here; one optimizer step over
        several micro-batches takes the proximal log-probs from each micro-batch's own (see
        :meth:`_fuses_proximal`). Returns ``(batch, first pass or None, fused)``."""
        alg = self.alg
        single = self._single_pass(batch)
        fused = not single and self._fuses_proximal(batch)  # fuses_proximal is False for a single pass anyway
        if single:
            batch = next(mini_batches(batch, alg.ppo_mini_batch_size, self.generator))  # same RNG use as _train
        if fused:  # the loss mask needs no proximal log-probs here (no rejection); the rest comes per micro-batch
            mask_truncated(alg, batch, metrics)
        if self.reference is not None:  # before the first pass, whose graph then stays alive until the backward
            batch.ref_logprobs = self._no_grad_trained_rows(
                lambda b: policy_forward(self.reference, b, alg.temperature, False)[0], batch, rows, fused
            )
        if fused:
            return batch, None, True
        first_pass = self._first_pass(batch) if single else None
        self.actor.eval()
        proximal, batch.old_values = self._proximal_and_values(batch, first_pass, rows)
        correct_rollout(alg, batch, proximal, metrics)
        return batch, first_pass, False

    def _kl_in_reward(self, batch: TrainBatch, token_rewards: torch.Tensor, rows: int, metrics: dict) -> torch.Tensor:
        """``r_t - kl_coef * KL_t`` with the adaptive or fixed controller's coefficient, which this batch updates."""
        kl_tok = self._reference_kl(batch, rows)
        token_rewards, kl_info = algo.apply_kl_to_rewards(
            token_rewards, kl_tok, self.kl_ctrl.value, batch.response_mask
        )
        metrics["actor/reward_kl"] = float(kl_info["kl"])
        metrics["actor/kl_coef"] = float(kl_info["kl_coef"])
        self.kl_ctrl.update(float(kl_info["kl"]), batch.size)
        return token_rewards

    def _train(self, batch: TrainBatch, first_pass: Optional[_FirstPass], fused: bool, metrics: dict) -> None:
        """``ppo_epochs`` passes over shuffled mini-batches (or the single pass's one), stopping early on
        ``early_stop_kl``; one learning-rate step per policy version. A fused step's one mini-batch returns the
        proximal log-probs its micro-batches produced, and the correction's batch figures are taken from them."""
        alg = self.alg
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
                proximal = self._update_mini_batch(self._prepare_mini_batch(mini), means, fused=fused)
                if proximal is not None:  # the figures of the rows that went through the forwards
                    trained = trained_rows(mini, self.critic is not None, self.world_size)
                    if trained is not None:
                        mini, proximal = mini.select(trained), proximal[trained]
                    proximal_terms(alg, mini, proximal, metrics)
                optimizer_steps += 1
                # the KL this mini-batch measured before its own step (as CleanRL): identical on every rank
                if alg.early_stop_kl is not None and self.last_mini_batch_kl > alg.early_stop_kl:
                    stopped = True
                    break
            if stopped:
                break
        advance(self.actor_sched)
        if self.critic_sched is not None:
            advance(self.critic_sched)
        metrics.update(means.result())
        metrics["actor/lr"] = self.actor_opt.param_groups[0]["lr"]
        metrics["actor/optimizer_steps"] = optimizer_steps
        metrics["actor/optimizer_steps_planned"] = planned
        metrics["actor/early_stopped"] = float(stopped)
        metrics["actor/single_pass"] = float(first_pass is not None)
        metrics["actor/fused_proximal"] = float(fused)

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
        return single_pass(self.alg, batch, self.world_size, self._has_dropout)

    def _fuses_proximal(self, batch: TrainBatch) -> bool:
        return fuses_proximal(self.alg, batch, self.world_size, self._has_dropout, self.critic is not None)

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
        return chunked(fn, batch, rows, self.no_grad_tokens)

    def _no_grad_trained_rows(self, fn, batch: TrainBatch, rows: int, masked: bool) -> torch.Tensor:
        """:meth:`_no_grad_rows` over the rows the loss trains on once the loss mask is final (``masked``), 0 for
        the others (:func:`passes.trained_rows`); over every row otherwise."""
        trained = trained_rows(batch, self.critic is not None, self.world_size) if masked else None
        if trained is None:
            return self._no_grad_rows(fn, batch, rows)
        out = self._no_grad_rows(fn, batch.select(trained), rows)
        full = out.new_zeros((batch.size, *out.shape[1:]))
        full[trained] = out
        return full

    def _prepare_mini_batch(self, mini: TrainBatch) -> TrainBatch:
        """Per-mini-batch constants computed before the micro-batch split: clip_cov / kl_cov's token selection."""
        alg = self.alg
        mode = algo.COV_LOSSES.get(alg.policy_loss)
        if mode is not None:
            ratio = alg.clip_cov_ratio if mode == "clip" else alg.kl_cov_ratio
            mini.token_select = algo.cov_select(
                mini.advantages, mini.old_logprobs, loss_mask(mini), mode, ratio,
                lb=alg.clip_cov_lb, ub=alg.clip_cov_ub, generator=self.generator,
            )
        return mini

    def _all_reduce(self, values: list[float]) -> list[float]:
        counts = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            counts = counts.to(self.device)
            dist.all_reduce(counts)
        return [float(x) for x in counts.cpu()]

    def _global_counts(self, mini: TrainBatch) -> LossNorms:
        """The mini-batch's loss denominators (:func:`algo.loss_denominators`), summed over the learner ranks."""
        return LossNorms.for_mini_batch(
            self.alg, self._all_reduce(list(algo.loss_denominators(mini.response_mask, loss_mask(mini))))
        )

    def _update_mini_batch(self, mini: TrainBatch, means: MetricMean, first_pass: Optional[_FirstPass] = None,
                           fused: bool = False) -> Optional[torch.Tensor]:
        """One optimizer step: gradients accumulated over the micro-batches, each loss its share of the mini-batch's
        (global normalisation), so losses are summed and ratio-type metrics are token-weighted means. A fused step
        returns the proximal log-probs ``[B, T]`` of the mini-batch's rows, collected from the micro-batches'
        training forwards (0 outside the response mask); otherwise None."""
        alg = self.alg
        norms = self._global_counts(mini)
        self.actor_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)
        loss_sums: dict[str, float] = defaultdict(float)
        kl_sum = kl_tokens = 0.0
        rows = [None] if first_pass else self._micro_batch_rows(mini)
        proximal = None
        for part in rows:
            micro = mini if first_pass else mini.select(part).narrowed()
            step_metrics, sums, kl_weighted, kept, micro_proximal = self._backward_micro_batch(
                micro, norms, first_pass, fused)
            if micro_proximal is not None:
                if proximal is None:
                    proximal = torch.zeros(mini.response_mask.shape, dtype=micro_proximal.dtype, device=self.device)
                proximal[part, : micro_proximal.shape[1]] = micro_proximal
            for key, value in sums.items():
                loss_sums[key] += value
            kl_sum += kl_weighted
            kl_tokens += kept
            means.add(step_metrics, float(micro.response_mask.sum()))
            self._footprints.append(forward_footprint(micro))
        # approx_kl of the whole mini-batch (all ranks): the early-stopping decision must be the same everywhere
        if alg.early_stop_kl is not None:
            kl_sum, kl_tokens = self._all_reduce([kl_sum, kl_tokens])
        self.last_mini_batch_kl = kl_sum / max(kl_tokens, 1.0)
        grad_norm, stepped = clip_and_step(self.actor_opt, self.actor.parameters(), self.cfg.trainer.grad_clip)
        extra = {"actor/grad_norm": grad_norm, "actor/skipped_step_frac": float(not stepped), **loss_sums}
        if self.critic_opt is not None:
            critic_norm, _ = clip_and_step(self.critic_opt, self.critic.parameters(), self.cfg.trainer.grad_clip)
            extra["critic/grad_norm"] = critic_norm
        means.add(extra, 1.0)
        return None if proximal is None else torch.where(mini.response_mask.bool(), proximal, 0.0)

    def _micro_batch_rows(self, mini: TrainBatch) -> list[torch.Tensor]:
        """The row indices of each micro-batch, over the rows the loss trains on (:func:`passes.trained_rows`)."""
        alg = self.alg
        trained = trained_rows(mini, self.critic is not None, self.world_size)
        if trained is None:
            return micro_batch_rows(mini, alg.micro_batch_size, alg.max_tokens_per_micro_batch)
        return [trained[part] for part in micro_batch_rows(mini.select(trained), alg.micro_batch_size,
                                                           alg.max_tokens_per_micro_batch)]

    def _micro_forward(self, micro: TrainBatch, first_pass: Optional[_FirstPass]):
        """``(logprobs, entropy, logits, values or None)`` with grad: the single pass's own, one actor forward
        through a shared value head, or the actor alone (the critic then runs after the actor's backward)."""
        alg = self.alg
        if first_pass is not None:
            return first_pass.logprobs, first_pass.entropy, first_pass.logits, first_pass.values
        if self.shared_critic:
            return policy_value_forward(self.actor, self.critic, micro, alg.temperature, alg.entropy_coef != 0)
        return (*policy_forward(self.actor, micro, alg.temperature, with_entropy=alg.entropy_coef != 0), None)

    def _backward_micro_batch(self, micro: TrainBatch, norms: LossNorms, first_pass: Optional[_FirstPass],
                              fused: bool = False):
        """Forward, losses and backward of one micro-batch: ``(metrics, loss sums, weighted approx_kl, kept
        tokens, proximal log-probs or None)``. FSDP averages gradients over ranks while the losses are already
        normalised by global counts, so each backward is scaled by the world size to undo the mean. In a fused step
        (:meth:`_fuses_proximal`) the forward's own log-probs, detached, are the proximal ones of these rows."""
        alg = self.alg
        scale = float(self.world_size)
        logprobs, entropy, logits, values = self._micro_forward(micro, first_pass)
        proximal = None
        if fused:
            proximal = logprobs.detach()
            micro.old_logprobs, weights, _ = proximal_terms(alg, micro, proximal, None)
            if weights is not None:
                micro.is_weights = weights
        if entropy is None:  # reported, not optimised: no autograd graph over the vocabulary
            with torch.no_grad():
                entropy = algo.entropy_from_logits(logits.detach())
        ref_logits = None
        if alg.use_kl_loss and self.kl_base == "full":
            with torch.no_grad():
                ref_logits = response_logits(self.reference, micro, alg.temperature)
        actor = actor_loss(alg, micro, logprobs, entropy, logits, ref_logits, norms)
        loss, metrics, sums = actor.loss, actor.metrics, dict(actor.loss_sums)
        if not self.shared_critic:  # the actor's graph is freed before the critic's forward
            (loss * scale).backward()
        if self.critic is not None:
            if values is None:
                values = value_forward(self.critic, micro)
            vf_loss, vf_metrics = critic_loss(alg, micro, values, norms)
            if self.shared_critic:  # one graph: policy and value losses through the shared body at once
                loss = loss + alg.vf_coef * vf_loss
            else:
                (alg.vf_coef * vf_loss * scale).backward()
            sums["critic/vf_loss"] = float(vf_loss.detach())
            metrics.update(vf_metrics)
        if self.shared_critic:
            (loss * scale).backward()
        return metrics, sums, actor.kl_weighted, actor.kept_tokens, proximal
