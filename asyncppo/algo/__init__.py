"""Pure PPO math over ``(batch, tokens)`` tensors with a ``response_mask`` (1 = valid response token).

No I/O, no distributed code: the learner feeds tensors in and gets losses, advantages and metrics
out. Variants are chosen by name through small registries (``ADV_ESTIMATORS``, ``LOSS_AGG_MODES``,
``KL_ESTIMATORS``, ``KL_CONTROLLERS``, ``POLICY_LOSSES``); an unknown name raises ``ValueError`` listing the allowed
ones. docs/algorithms.md gives each one's formula, when to use it and its name in other libraries.
"""

from .advantages import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    GROUP_STD_EPS,
    WHITEN_EPS,
    clip_advantages,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    get_adv_estimator,
    grpo_advantages,
    place_turn_rewards,
    reinforce_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from .aggregation import LOSS_AGG_MODES, aggregate, count_tokens_and_seqs, get_loss_agg, loss_denominators
from .kl import KL_ESTIMATORS, apply_kl_to_rewards, get_kl_estimator, kl_loss, kl_penalty, mismatch_kl
from .kl_controller import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_controller_from_config,
)
from .logits import entropy_from_logits, logprobs_from_logits
from .normalize import (
    REWARD_NORM_MODES,
    RunningMeanStd,
    clip_rewards,
    group_mean_std,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    normalize_rewards,
    overlong_penalty,
    scores_to_token_rewards,
)
from .policy_loss import OFF_POLICY_CORRECTIONS, OFF_POLICY_TRUNCATIONS, combine_actor_loss, policy_loss
from .policy_loss_registry import COV_LOSSES, POLICY_LOSSES, LossParams, cov_select, get_policy_loss
from .rollout_correction import (
    IS_LEVELS,
    IS_TRUNCATIONS,
    REJECTION_LEVELS,
    REJECTION_STATS,
    ratio_metrics,
    rollout_correction,
)
from .transitions import flat_whiten, transition_gae
from .value_loss import explained_variance, value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "GROUP_STD_EPS",
    "WHITEN_EPS",
    "clip_advantages",
    "compute_advantages",
    "discounted_returns",
    "place_turn_rewards",
    "gae_advantages",
    "get_adv_estimator",
    "grpo_advantages",
    "reinforce_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "LOSS_AGG_MODES",
    "aggregate",
    "count_tokens_and_seqs",
    "get_loss_agg",
    "loss_denominators",
    "KL_ESTIMATORS",
    "apply_kl_to_rewards",
    "get_kl_estimator",
    "kl_loss",
    "kl_penalty",
    "mismatch_kl",
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "kl_controller_from_config",
    "entropy_from_logits",
    "logprobs_from_logits",
    "REWARD_NORM_MODES",
    "RunningMeanStd",
    "clip_rewards",
    "group_mean_std",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_rewards",
    "overlong_penalty",
    "scores_to_token_rewards",
    "OFF_POLICY_CORRECTIONS",
    "OFF_POLICY_TRUNCATIONS",
    "combine_actor_loss",
    "policy_loss",
    "COV_LOSSES",
    "POLICY_LOSSES",
    "LossParams",
    "cov_select",
    "get_policy_loss",
    "IS_LEVELS",
    "IS_TRUNCATIONS",
    "REJECTION_LEVELS",
    "REJECTION_STATS",
    "ratio_metrics",
    "rollout_correction",
    "flat_whiten",
    "transition_gae",
    "explained_variance",
    "value_loss",
]
