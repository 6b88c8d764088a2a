"""Checks for the algorithm family options (policy losses, rollout correction, DAPO batch shaping, early stopping).

Kept apart from :mod:`asyncppo.config.validate` (which calls :func:`check_algorithm_family` from its algorithm
checks) only to keep that module short; the rules follow the same style: every problem names the key, the value
and what is allowed, and legal-but-useless combinations are warnings.
"""

from __future__ import annotations

from asyncppo.config import choices as C


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
