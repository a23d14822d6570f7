"""PPO-family algorithm math as pure torch functions (definitions: shared/reference/algorithms.md).

Per-token tensors are [batch, response_len]; `mask` is the response mask (1 = real response token).

    from rlfabric import algorithms as algos
    adv, ret = algos.get_advantage_estimator("grpo")(token_rewards=r, mask=m, group_ids=uid)
    loss, stats = algos.policy_loss(old_logp, logp, adv, m, clip_high=0.28, mode="vanilla")

Modules: stats (masked statistics), advantages (GAE, GRPO, RLOO, REINFORCE++, ReMax and VeRL's outcome
variants), losses (aggregation, PPO's policy losses, the value loss), reinforce_losses and surrogate_losses
(VeRL's other policy losses), kl (KL estimators, controllers, KL in the reward), distill
(on-policy distillation's per-token reverse-KL advantages), logits
(log-probs and entropy from logits), dapo (dynamic sampling), rollout_correction
(rollout/trainer mismatch: metrics, truncated IS, rejection), token_baseline (the Optimal Token
Baseline estimators), bypass (the bypass_mode loss), registry (by-name lookup), plugins
(algorithm.plugin_modules; not imported here).
"""

from .advantages import (
    compute_gae,
    compute_gdpo_advantage,
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
)
from .bypass import bypass_mode_loss
from .dapo import filter_groups
from .distill import distill_advantages
from .kl import AdaptiveKLController, FixedKLController, kl_in_reward, kl_penalty
from .logits import (
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_from_logits,
    sum_pi_squared_from_logits,
)
from .losses import AGG_MODES, aggregate_loss, gspo_loss, policy_loss, ppo_clip_loss, value_loss
from .registry import (
    ADVANTAGE_ESTIMATOR_KWARGS,
    ESTIMATOR_INPUTS,
    POLICY_LOSS_SECTIONS,
    advantage_estimator_inputs,
    advantage_estimator_names,
    advantage_estimator_params,
    get_advantage_estimator,
    get_policy_loss,
    policy_loss_names,
    policy_loss_params,
    register_advantage_estimator,
    register_policy_loss,
)
from .reinforce_losses import cispo_loss, dppo_kl_loss, dppo_tv_loss, dro_loss, gpg_loss
from .rollout_correction import RolloutCorrection, mismatch_metrics, rollout_correction
from .stats import masked_mean, masked_var, masked_whiten
from .surrogate_losses import clip_cov_loss, geo_mean_loss, kl_cov_loss, sapo_loss
from .token_baseline import (
    compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
    path_variance,
)

__all__ = [
    "ADVANTAGE_ESTIMATOR_KWARGS",
    "AGG_MODES",
    "ESTIMATOR_INPUTS",
    "POLICY_LOSS_SECTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "advantage_estimator_inputs",
    "advantage_estimator_names",
    "advantage_estimator_params",
    "aggregate_loss",
    "bypass_mode_loss",
    "cispo_loss",
    "clip_cov_loss",
    "compute_gae",
    "compute_gdpo_advantage",
    "compute_gpg_advantage",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_opo_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "compute_tir_optimal_token_baseline_advantage",
    "distill_advantages",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "entropy_from_logits",
    "filter_groups",
    "get_advantage_estimator",
    "geo_mean_loss",
    "get_policy_loss",
    "gpg_loss",
    "gspo_loss",
    "kl_cov_loss",
    "kl_in_reward",
    "kl_penalty",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "path_variance",
    "policy_loss",
    "policy_loss_names",
    "policy_loss_params",
    "ppo_clip_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "RolloutCorrection",
    "mismatch_metrics",
    "rollout_correction",
    "sapo_loss",
    "sum_pi_squared_from_logits",
    "value_loss",
]
