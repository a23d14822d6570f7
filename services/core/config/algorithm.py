"""algorithm: advantages, KL, rollout correction, dynamic sampling, on-policy distillation."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from rlfabric.core.config.base import Section


class RolloutCorrectionConfig(Section):
    rollout_is: Literal["token", "sequence"] | None = None
    """Truncated importance sampling (TIS) of the policy loss against the rollout/trainer mismatch: each
    token's loss is multiplied by min(r, rollout_is_threshold), r = pi_old / pi_rollout of the token
    (token) or the product over its sequence (sequence); null = off. Needs the trainer's old log-probs, so
    the old-log-prob forward pass runs (see old_log_prob_source) (VeRL: algorithm.rollout_correction)."""
    rollout_is_threshold: float = Field(2.0, gt=0)
    """The truncation C of the IS weights: weight = min(r, C)."""
    rollout_rs: Literal["token", "sequence"] | None = None
    """Rejection (masked IS): tokens whose r (token), or sequences whose product of r (sequence), lie
    outside [rollout_rs_threshold_lower, rollout_rs_threshold] are left out of the actor's and critic's
    losses (the advantages were computed before); null = off."""
    rollout_rs_threshold: float = Field(2.0, gt=1)
    """Upper bound of the ratio a token or sequence keeps under rollout_rs."""
    rollout_rs_threshold_lower: float | None = Field(None, ge=0)
    """Lower bound of the ratio under rollout_rs; null = 1 / rollout_rs_threshold."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """actor.loss_mode bypass_mode only (VeRL's bypass mode), where r = pi / pi_rollout is taken against the
    policy being updated and the settings above apply inside the loss: ppo_clip = the PPO clip on r (no IS
    weights), reinforce = -sg(w) A log pi with w the truncated IS weights of r (1 with rollout_is null)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> RolloutCorrectionConfig:
        lower = self.rollout_rs_threshold_lower
        if lower is not None and lower >= self.rollout_rs_threshold:
            raise ValueError(f"rollout_rs_threshold_lower {lower} must be below rollout_rs_threshold "
                             f"{self.rollout_rs_threshold}")
        return self

    def enabled(self) -> bool:
        """A correction that changes the update is on (off: the rollout_corr/* metrics only)."""
        return self.rollout_is is not None or self.rollout_rs is not None


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (VeRL: algorithm.filter_groups): groups with no spread in their reward teach
    nothing to a group baseline, so they are dropped and generation goes on until the step's batch is full."""

    enable: bool = False
    """Drop each prompt's group whose samples all have the same `metric`, and generate more prompts instead."""
    metric: str = "score"
    """What must vary within a group: score (the reward) or the name of a numeric output of the scorer (e.g.
    acc). VeRL's default is acc; rlfabric's is score, which every scorer gives."""
    max_num_gen_batches: int = Field(0, ge=0)
    """Most gen batches (data.train_batch_size prompts each) one step may draw; 0 = no limit. A step that
    reaches it with fewer groups than its batch needs fails (FAILED_PRECONDITION), as in VeRL."""


class DistillConfig(Section):
    """On-policy distillation: the student (the actor) samples, the teacher (the `teacher` role, teacher.model_path)
    scores every sampled token, and each token's reverse KL log pi_student - log pi_teacher is its training
    signal, as a per-token advantage (docs/distillation.md)."""

    enable: bool = False
    """Run a teacher service and train on the per-token reverse KL to it: advantage_t = -weight * (log
    pi_student(y_t) - log pi_teacher(y_t)) on the sampled tokens (no discount: each token's own)."""
    weight: float = Field(1.0, gt=0)
    """The reverse-KL term's coefficient in the advantages."""
    use_task_reward: bool = False
    """Add the task reward's advantages (adv_estimator on the reward service's scores) to the distillation
    term; false = the teacher's signal alone (the scores are still computed and reported)."""


class AlgorithmConfig(Section):
    """The RL algorithm: advantage estimator, KL in the reward, rollout correction, distillation and plugins."""

    adv_estimator: str = "grpo"
    """Advantage estimator, VeRL's names: gae, grpo, rloo, reinforce_plus_plus, remax, grpo_passk,
    reinforce_plus_plus_baseline, opo, gpg, gdpo, grpo_vectorized, rloo_vectorized, optimal_token_baseline,
    tir_optimal_token_baseline (these two ask the actor's log-prob pass for sum_pi_squared), or one you
    registered."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO (and grpo_vectorized, grpo_passk, gdpo): divide by the group's reward std (False = Dr. GRPO's
    mean-only baseline)."""
    gdpo_reward_keys: list[str] = []
    """adv_estimator gdpo: the scorer outputs that are its reward components (the numbers a compute_score dict
    returns beside its score, e.g. [format_reward, accuracy_reward]); each is normalized within its group on its
    own before their weighted sum. Every scored sample must have them."""
    gdpo_reward_weights: list[float] | None = None
    """adv_estimator gdpo: a weight per gdpo_reward_keys entry; null = 1 each."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || reference) from the token rewards (PPO-RLHF style)."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"
    """In-reward KL coefficient: fixed, or adaptive towards kl_target (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0)
    """In-reward KL coefficient (the adaptive controller's starting value)."""
    kl_target: float = Field(0.1, gt=0)
    """Adaptive controller: the KL it steers towards."""
    kl_horizon: int = Field(10000, gt=0)
    """Adaptive controller: horizon in samples of its proportional update."""
    score_failure: Literal["mask", "zero"] = "mask"
    """A sample whose scoring failed (the reward function raised, timed out or crashed): mask = left out of
    the advantages and losses, its group's baseline included; zero = trained on with score 0. Either way
    reward/score_failed/{count,fraction} counts them, the coordinator logs them counted by reason, and
    trainer.dump_rollouts records each one's reason (failure) in RUN_DIR/rollouts/step_N.jsonl."""
    max_failed_fraction: float = Field(0.5, ge=0, le=1)
    """Most of a step's samples that may fail (the reward function failed on them, or with rollout.multi_turn
    their environment did): a step with more fails the run before it trains (RUN_STATE_FAILED, no final
    model), its error counting the failures by reason (e.g. "env UNAVAILABLE: 32"); 1 = never."""
    old_log_prob_source: Literal["auto", "actor", "rollout"] = "auto"
    """Where the PPO ratio's old log-probs come from. auto: a separate actor forward pass, skipped when the
    update is one optimizer step (one mini-batch, actor.ppo_epochs 1) and nothing reads them before it (KL
    in the reward, rollout correction, algorithm.distill): the actor then takes them inside that step from the policy it is
    updating; perf/old_log_prob_forward says which (1 = the forward pass ran). actor: always the forward
    pass (the rollout_corr/* metrics need it). rollout: the rollout engine's log-probs of the sampled tokens
    (no forward pass; VeRL's bypass mode): the ratio is then taken against the policy that sampled, so the
    mismatch is part of what PPO clips and rollout_correction cannot be on. The rollout's log-probs are of
    the distribution it sampled from: with rollout.top_p < 1 or top_k on, the filtered one."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Measuring and correcting the mismatch between the rollout engine's log-probs (pi_rollout) and the
    trainer's (pi_old): rollout_corr/* metrics every step that has both, truncated IS and rejection."""
    plugin_modules: list[str] = []
    """Python modules the coordinator and the actor import at start, so their register_advantage_estimator
    and register_policy_loss calls add names adv_estimator and actor.loss_mode can pick
    (rlfabric.algorithms.plugins). Only the mesh's own config may name them: a StartRun cannot add one."""
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    """Dynamic sampling (DAPO): groups whose samples all scored alike are dropped and more prompts drawn."""
    distill: DistillConfig = DistillConfig()
    """On-policy distillation from a teacher model (the teacher section holds its model and resources)."""

    @model_validator(mode="after")
    def _gdpo_components(self) -> AlgorithmConfig:
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if self.adv_estimator == "gdpo" and not keys:
            raise ValueError("adv_estimator gdpo needs gdpo_reward_keys: the scorer outputs it normalizes one by one")
        if weights is not None and len(weights) != len(keys):
            raise ValueError(f"gdpo_reward_weights has {len(weights)} weights for {len(keys)} gdpo_reward_keys")
        return self
