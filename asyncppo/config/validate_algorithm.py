"""Every ``algorithm.*`` check: estimator, rewards, losses, schedule, off-policy correction and the family options.

:func:`check_algorithm` is what :mod:`asyncppo.config.validate` calls, and
:func:`check_algorithm_family` covers the policy-loss family options within it. The rules follow one style: every
problem names the key, the value and what is allowed, and legal-but-useless combinations are warnings.
"""

from __future__ import annotations

from asyncppo.config import choices as C
from asyncppo.config.checks import Checks, mini_batch_prompts, uses_critic
from asyncppo.config.schema import AsyncPPOConfig


def check_algorithm_family(cfg, c) -> None:
    a, r = cfg.algorithm, cfg.rollout
    c.choice("algorithm.policy_loss", a.policy_loss, C.POLICY_LOSSES)
    c.positive("algorithm.tis_cap", a.tis_cap)
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        value = getattr(a, key)
        if not 0 < value <= 1:
            c.error(f"algorithm.{key}", value, "must be in (0, 1]: the fraction of tokens selected")
    if not a.clip_cov_lb < a.clip_cov_ub:
        c.error("algorithm.clip_cov_ub", a.clip_cov_ub, f"must be > algorithm.clip_cov_lb={a.clip_cov_lb}")
    c.non_negative("algorithm.kl_cov_coef", a.kl_cov_coef)
    if a.policy_loss in ("gspo", "gmpo") and a.loss_agg_mode != "seq-mean-token-mean":
        c.warn(f"algorithm.policy_loss={a.policy_loss} is a sequence-level loss; its papers aggregate with "
               f"loss_agg_mode=seq-mean-token-mean (got {a.loss_agg_mode}: long sequences weigh more)")
    if a.dual_clip_loss and a.policy_loss not in ("ppo", "gspo", "clip_cov"):
        c.warn(f"algorithm.dual_clip_loss has no effect with policy_loss={a.policy_loss} (only ppo, gspo, clip_cov)")
    if a.early_stop_kl is not None and a.early_stop_kl <= 0:
        c.error("algorithm.early_stop_kl", a.early_stop_kl, "must be null (never stop early) or > 0")
    # rollout correction
    c.choice("algorithm.off_policy_level", a.off_policy_level, C.OFF_POLICY_LEVELS)
    c.choice("algorithm.off_policy_truncation", a.off_policy_truncation, C.OFF_POLICY_TRUNCATIONS)
    if a.off_policy_truncation == "icepop" and not 0 <= a.off_policy_cap_low < 1:
        c.error("algorithm.off_policy_cap_low", a.off_policy_cap_low, "must be in [0, 1) with "
                "off_policy_truncation=icepop (the lower bound of the kept ratio; an on-policy token has ratio 1)")
    c.choice("algorithm.rejection", a.rejection, C.REJECTION_LEVELS)
    c.choice("algorithm.rejection_stat", a.rejection_stat, C.REJECTION_STATS)
    if a.rejection != "none":
        if not a.rejection_low < a.rejection_high:
            c.error("algorithm.rejection_high", a.rejection_high,
                    f"must be > algorithm.rejection_low={a.rejection_low}")
        elif a.rejection_stat == "ratio" and not a.rejection_low <= 1 <= a.rejection_high:
            c.error("algorithm.rejection_low", a.rejection_low, "with rejection_stat=ratio, [rejection_low, "
                    "rejection_high] must contain 1, else even on-policy tokens are rejected")
        elif a.rejection_stat in ("k2", "k3") and not a.rejection_low <= 0 <= a.rejection_high:
            c.error("algorithm.rejection_low", a.rejection_low, f"with rejection_stat={a.rejection_stat} (>= 0, "
                    "0 when on-policy), [rejection_low, rejection_high] must contain 0")
    if a.off_policy_correction == "none" and (a.rejection != "none" or a.off_policy_normalize
                                              or a.off_policy_level != "token" or a.off_policy_truncation != "clip"):
        c.warn("algorithm.off_policy_correction=none: the behaviour log-probs are the old log-probs, so "
               "rejection, off_policy_level, off_policy_truncation and off_policy_normalize have nothing to act on")
    # DAPO batch shaping
    c.non_negative("algorithm.overlong_buffer_len", a.overlong_buffer_len)
    if a.overlong_buffer_len > r.response_length:
        c.error("algorithm.overlong_buffer_len", a.overlong_buffer_len,
                f"must be <= rollout.response_length={r.response_length} (the ramp ends at the length limit)")
    c.non_negative("algorithm.overlong_penalty_factor", a.overlong_penalty_factor)
    c.non_negative("algorithm.dynamic_sampling_max_skip", a.dynamic_sampling_max_skip)
    if a.dynamic_sampling and r.num_return_sequences_in_group < 2:
        c.error("algorithm.dynamic_sampling", True, "needs rollout.num_return_sequences_in_group >= 2 (a group of "
                "one always has 'all rewards equal')")
    if a.dynamic_sampling and a.adv_estimator == "gae":
        c.warn("algorithm.dynamic_sampling with adv_estimator=gae: all-equal groups still carry signal through "
               "the critic's baseline; skipping them is meant for group estimators (grpo, rloo, ...)")


def check_algorithm(cfg: AsyncPPOConfig, c: Checks) -> None:
    """Every ``algorithm.*`` rule, in the order its messages are listed: estimator and rewards, losses, schedule,
    off-policy correction."""
    _check_estimator_and_rewards(cfg, c)
    _check_losses(cfg, c)
    _check_schedule(cfg, c)
    _check_correction(cfg, c)


def _check_estimator_and_rewards(cfg: AsyncPPOConfig, c: Checks) -> None:
    a, r = cfg.algorithm, cfg.rollout
    c.choice("algorithm.adv_estimator", a.adv_estimator, C.ADV_ESTIMATORS)
    c.in_range("algorithm.gamma", a.gamma, 0.0, 1.0)
    c.in_range("algorithm.lambd", a.lambd, 0.0, 1.0)
    c.optional_positive("algorithm.advantage_clip", a.advantage_clip, " (no clipping)")
    if a.use_critic is False and a.adv_estimator == "gae":
        c.error("algorithm.use_critic", False, "must be true or null with adv_estimator=gae (GAE needs a value model)")
    if a.use_critic and a.adv_estimator in C.ADV_ESTIMATORS and a.adv_estimator != "gae":
        c.warn(f"algorithm.use_critic=true with adv_estimator={a.adv_estimator}: the critic is trained but its values "
               "are not used by this estimator")
    if a.adv_estimator in C.GROUP_ADV_ESTIMATORS and r.num_return_sequences_in_group < 2:
        c.error("rollout.num_return_sequences_in_group", r.num_return_sequences_in_group,
                f"must be >= 2 with adv_estimator={a.adv_estimator} (its baseline comes from the other samples "
                "of the same prompt)")
    # reward shaping
    c.optional_positive("algorithm.reward_clip", a.reward_clip, " (no clipping)")
    c.choice("algorithm.reward_norm", a.reward_norm, C.REWARD_NORMS)
    if a.reward_shift and a.reward_scale:
        c.error("algorithm.reward_scale", True, "reward_shift and reward_scale are exclusive: set at most one "
                "(both false gives full (x - mean) / std normalisation)")
    if (a.reward_shift or a.reward_scale) and a.reward_norm is None:
        c.warn("algorithm.reward_shift/reward_scale have no effect while algorithm.reward_norm is null")


def _check_losses(cfg: AsyncPPOConfig, c: Checks) -> None:
    """Policy loss, value loss and KL terms."""
    a = cfg.algorithm
    c.positive("algorithm.pg_clip", a.pg_clip)
    if a.clip_ratio_low is not None and not 0 < a.clip_ratio_low < 1:
        c.error("algorithm.clip_ratio_low", a.clip_ratio_low, "must be null (= pg_clip) or in (0, 1): the ratio is "
                "clipped below at 1 - clip_ratio_low")
    c.optional_positive("algorithm.clip_ratio_high", a.clip_ratio_high, " (= pg_clip)")
    if a.pg_clip >= 1 and a.clip_ratio_low is None:
        c.error("algorithm.pg_clip", a.pg_clip, "must be < 1 while clip_ratio_low is null (clip_ratio_low defaults "
                "to pg_clip and 1 - clip_ratio_low must stay > 0); set algorithm.clip_ratio_low explicitly")
    if a.clip_ratio_c <= 1:
        c.error("algorithm.clip_ratio_c", a.clip_ratio_c, "must be > 1 (dual-clip bound on the ratio for negative "
                "advantages)")
    c.non_negative("algorithm.entropy_coef", a.entropy_coef)
    check_algorithm_family(cfg, c)
    c.choice("algorithm.loss_agg_mode", a.loss_agg_mode, C.LOSS_AGG_MODES)
    c.optional_positive("algorithm.loss_agg_norm_length", a.loss_agg_norm_length, " (= rollout.response_length)")
    # value loss
    c.optional_positive("algorithm.value_clip", a.value_clip, " (no clipping)")
    c.optional_positive("algorithm.huber_delta", a.huber_delta, " (squared error)")
    c.non_negative("algorithm.vf_coef", a.vf_coef)
    if a.vf_coef == 0 and uses_critic(cfg):
        c.warn("algorithm.vf_coef=0 with a critic: the value model is never trained")
    # KL
    c.non_negative("algorithm.kl_loss_coef", a.kl_loss_coef)
    c.choice("algorithm.kl_penalty", a.kl_penalty, C.KL_PENALTIES)
    c.choice("algorithm.kl_ctrl.type", a.kl_ctrl.type, C.KL_CTRL_TYPES)
    c.non_negative("algorithm.kl_ctrl.init_kl_coef", a.kl_ctrl.init_kl_coef)
    c.positive("algorithm.kl_ctrl.target_kl", a.kl_ctrl.target_kl)
    c.positive("algorithm.kl_ctrl.kl_horizon", a.kl_ctrl.kl_horizon)
    if a.use_kl_loss and a.add_token_level_kl:
        # verl accepts both (it only prints a notice); so do we, loudly: the KL is then penalised twice.
        c.warn("algorithm.use_kl_loss and algorithm.add_token_level_kl are both true: the KL to the reference is "
               "penalised twice (in the reward and in the loss)")


def _check_schedule(cfg: AsyncPPOConfig, c: Checks) -> None:
    """Epochs, mini-batches and micro-batches: each must split the batch into whole prompt groups."""
    a, r = cfg.algorithm, cfg.rollout
    c.positive("algorithm.ppo_epochs", a.ppo_epochs)
    c.non_negative("algorithm.ppo_mini_batch_size", a.ppo_mini_batch_size)
    c.non_negative("algorithm.ppo_num_mini_batches", a.ppo_num_mini_batches)
    c.non_negative("algorithm.micro_batch_size", a.micro_batch_size)
    c.non_negative("algorithm.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch)
    B, n = r.rollout_batch_size, r.num_return_sequences_in_group
    if a.ppo_mini_batch_size > 0 and B > 0 and B % a.ppo_mini_batch_size:
        c.error("algorithm.ppo_mini_batch_size", a.ppo_mini_batch_size,
                f"must divide rollout.rollout_batch_size={B} (prompts per mini-batch), or be 0 for the whole batch")
    N = min(a.ppo_num_mini_batches, B)
    if a.ppo_mini_batch_size == 0 and N > 1 and B > 0 and B % N and cfg.env.id is None:
        c.error("algorithm.ppo_num_mini_batches", N, f"must divide rollout.rollout_batch_size={B} (whole prompt "
                "groups per mini-batch); or set algorithm.ppo_mini_batch_size, which takes precedence")
    mini_samples = mini_batch_prompts(cfg) * n
    if a.micro_batch_size > 0 and mini_samples > 0 and mini_samples % a.micro_batch_size:
        c.error("algorithm.micro_batch_size", a.micro_batch_size,
                f"must divide the mini-batch of {mini_samples} samples (ppo_mini_batch_size x "
                "num_return_sequences_in_group), or be 0 for the whole mini-batch")
    seq_len = r.prompt_length + r.response_length
    if 0 < a.max_tokens_per_micro_batch < seq_len:
        c.error("algorithm.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch,
                f"must be 0 (off) or >= prompt_length + response_length = {seq_len} so that one sample fits")
    tg = cfg.cluster.shared_gpus or cfg.cluster.train_gpus  # learner ranks (--gpus N: one per shared device)
    mini_prompts = mini_batch_prompts(cfg)
    if tg > 1 and mini_prompts > 0 and mini_prompts % tg:
        c.error("cluster.shared_gpus" if cfg.cluster.shared_gpus else "cluster.train_gpus", tg, f"must divide the mini-batch of {mini_prompts} prompt groups so every "
                "learner rank gets the same whole groups")
    elif tg > 1 and a.micro_batch_size > 0 and (mini_samples // tg) % a.micro_batch_size:
        c.error("algorithm.micro_batch_size", a.micro_batch_size, f"must divide each learner rank's share of "
                f"{mini_samples // tg} samples, so every rank runs the same number of micro-batches")
    if tg > 1 and a.max_tokens_per_micro_batch > 0:
        c.error("algorithm.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch, "must be 0 with several "
                "learner ranks (cluster.train_gpus > 1): a token budget can give ranks different micro-batch counts, "
                "and every micro-batch is a collective; use algorithm.micro_batch_size")


def _check_routing_replay(cfg: AsyncPPOConfig, c: Checks) -> None:
    """``algorithm.routing_replay`` (docs/moe.md): where the engine's expert choices can travel and be replayed.
    Whether the model has experts at all is checked when the learner loads it."""
    mode = cfg.algorithm.routing_replay
    c.choice("algorithm.routing_replay", mode, C.ROUTING_REPLAY)
    if mode == "off":
        return
    if cfg.env.id is not None:
        c.error("algorithm.routing_replay", mode, "is for mixture-of-experts language models; an embodied run has no "
                "experts (set it to off)")
    engine_records = mode in ("measure", "rollout")  # learner: the learner's own routing, no engine record
    if engine_records and cfg.rollout.tensor_parallel_size > 1:
        c.error("algorithm.routing_replay", mode, "needs rollout.tensor_parallel_size=1: a tensor-parallel engine's "
                "routers run in other processes, where the capture cannot read them")
    if mode in ("rollout", "learner") and cfg.model.gradient_checkpointing:
        c.error("algorithm.routing_replay", mode, "cannot run with model.gradient_checkpointing: the forward "
                "recomputed in the backward would route itself, not by the engine's record")


def _check_correction(cfg: AsyncPPOConfig, c: Checks) -> None:
    """Off-policy correction and the temperature the learner recomputes log-probs at."""
    a, r = cfg.algorithm, cfg.rollout
    c.choice("algorithm.off_policy_correction", a.off_policy_correction, C.OFF_POLICY_CORRECTIONS)
    _check_routing_replay(cfg, c)
    if a.off_policy_cap < 1:
        c.error("algorithm.off_policy_cap", a.off_policy_cap, "must be >= 1 (a cap below 1 truncates even "
                "on-policy samples, whose weight is 1)")
    c.positive("algorithm.temperature", a.temperature)
    t_s = r.sampling.temperature
    if a.temperature > 0 and t_s > 0 and a.temperature != t_s:
        c.error("algorithm.temperature", a.temperature,
                f"must equal rollout.sampling.temperature={t_s}: behaviour log-probs are taken at the sampling "
                "temperature, so recomputing them at another one biases every importance ratio")
