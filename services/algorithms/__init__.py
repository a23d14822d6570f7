"""PPO-family algorithm math as pure torch functions (definitions: shared/reference/algorithms.md).

Per-token tensors are [batch, response_len]; `mask` is the response mask (1 = real response token).

    from rlfabric import algorithms as algos
    adv, ret = algos.get_advantage_estimator("grpo")(token_rewards=r, mask=m, group_ids=uid)
    loss, stats = algos.policy_loss(old_logp, logp, adv, m, clip_high=0.28, mode="vanilla")

Modules: stats (masked statistics), advantages (GAE, GRPO, RLOO, REINFORCE++, ReMax), losses
(aggregation, policy and value losses), kl (KL estimators, controllers, KL in the reward), logits
(log-probs and entropy from logits), dapo (dynamic sampling), rollout_correction
(rollout/trainer mismatch: metrics, truncated IS, rejection), registry (by-name lookup), plugins
(algorithm.plugin_modules; not imported here).
"""

from .advantages import (
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
)
from .dapo import filter_groups
from .kl import AdaptiveKLController, FixedKLController, kl_in_reward, kl_penalty
from .logits import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from .losses import AGG_MODES, aggregate_loss, gspo_loss, policy_loss, ppo_clip_loss, value_loss
from .registry import (
    ADVANTAGE_ESTIMATOR_KWARGS,
    advantage_estimator_names,
    get_advantage_estimator,
    get_policy_loss,
    policy_loss_names,
    register_advantage_estimator,
    register_policy_loss,
)
from .rollout_correction import RolloutCorrection, mismatch_metrics, rollout_correction
from .stats import masked_mean, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATOR_KWARGS",
    "AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "advantage_estimator_names",
    "aggregate_loss",
    "compute_gae",
    "compute_grpo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "entropy_from_logits",
    "filter_groups",
    "get_advantage_estimator",
    "get_policy_loss",
    "gspo_loss",
    "kl_in_reward",
    "kl_penalty",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "policy_loss_names",
    "ppo_clip_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "RolloutCorrection",
    "mismatch_metrics",
    "rollout_correction",
    "value_loss",
]
