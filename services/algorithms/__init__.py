"""PPO-family algorithm math as pure torch functions (definitions: shared/reference/algorithms.md).

Per-token tensors are [batch, response_len]; `mask` is the response mask (1 = real response token).

    from rlfabric import algorithms as algos
    adv, ret = algos.get_advantage_estimator("grpo")(token_rewards=r, mask=m, group_ids=uid)
    loss, stats = algos.policy_loss(old_logp, logp, adv, m, clip_high=0.28, mode="vanilla")

Modules: stats (masked statistics), advantages (GAE, GRPO, RLOO, REINFORCE++, ReMax), losses
(aggregation, policy and value losses), kl (KL estimators, controllers, KL in the reward), logits
(log-probs and entropy from logits), dapo (dynamic sampling), mismatch
(rollout/trainer mismatch: metrics, truncated IS, rejection), registry (by-name lookup), plugins
(algorithm.plugin_modules).

Each name below is imported from its module when first used (PEP 562), so `rlfabric.algorithms.registry` and
`plugins` load without torch: `rlfabric check` names a mistyped estimator in a blink.
"""

from importlib import import_module

# name -> the module of this package that defines it
_HOMES = {
    "advantages": ("compute_gae", "compute_grpo_advantage", "compute_reinforce_pp_advantage",
                   "compute_remax_advantage", "compute_rloo_advantage"),
    "dapo": ("filter_groups",),
    "kl": ("AdaptiveKLController", "FixedKLController", "kl_in_reward", "kl_penalty"),
    "logits": ("entropy_from_logits", "log_probs_and_entropy", "log_probs_from_logits"),
    "losses": ("AGG_MODES", "aggregate_loss", "gspo_loss", "policy_loss", "ppo_clip_loss", "value_loss"),
    "registry": ("ADVANTAGE_ESTIMATOR_KWARGS", "advantage_estimator_names", "get_advantage_estimator",
                 "get_policy_loss", "policy_loss_names", "register_advantage_estimator", "register_policy_loss"),
    "mismatch": ("RolloutCorrection", "mismatch_metrics", "rollout_correction"),
    "stats": ("masked_mean", "masked_var", "masked_whiten"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOME_OF[name]}"), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
