"""VeRL's bypass_mode policy loss: the old policy is the rollout's (algorithm.old_log_prob_source rollout, so
no old-log-prob forward pass runs), and rollout correction is taken inside the loss, against the policy being
updated: r_t = pi(y_t) / pi_rollout(y_t), detached.

- loss_type ppo_clip: the PPO clip (vanilla) on r itself, on the tokens rejection keeps; no IS weights (the
  clipped ratio already is the IS correction).
- loss_type reinforce: -sg(w) A log pi with w the truncated IS weights of r (rollout_is token or sequence;
  1 when off), on the tokens rejection keeps; stat ppo_kl = mean(log pi_rollout - log pi).

The IS and rejection settings are algorithm.rollout_correction's (rollout_correction.rollout_correction).
Per-token tensors are [batch, response_len].
"""

import torch

from .losses import detached, ppo_clip_loss, weighted_aggregate
from .registry import register_policy_loss
from .rollout_correction import rollout_correction
from .stats import masked_mean

LOSS_TYPES = ("ppo_clip", "reinforce")


def bypass_mode_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                     agg=None, rollout_is_weights=None, rollout_correction_settings=None, **counts):
    """The bypass-mode loss above; old_log_probs are the rollout's. rollout_correction_settings: an object with
    loss_type, rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold and
    rollout_rs_threshold_lower (algorithm.rollout_correction); None = ppo_clip without IS or rejection.
    rollout_is_weights must be None: the weights are taken here."""
    if rollout_is_weights is not None:
        raise ValueError("bypass_mode_loss: rollout_is_weights must be None; bypass mode computes its own from "
                         "the policy being updated")
    settings = rollout_correction_settings
    loss_type = "ppo_clip" if settings is None else settings.loss_type
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"bypass_mode_loss: loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    weights, kept = None, mask
    if settings is not None:
        with torch.no_grad():
            correction = rollout_correction(
                log_probs.detach(), old_log_probs, mask, rollout_is=settings.rollout_is,
                rollout_is_threshold=settings.rollout_is_threshold, rollout_rs=settings.rollout_rs,
                rollout_rs_threshold=settings.rollout_rs_threshold,
                rollout_rs_threshold_lower=settings.rollout_rs_threshold_lower)
        weights, kept = correction.weights, correction.mask.to(log_probs.dtype)
    if loss_type == "ppo_clip":
        return ppo_clip_loss(old_log_probs, log_probs, advantages, kept, clip_low=clip_low, clip_high=clip_high,
                             clip_ratio_c=clip_ratio_c, agg=agg, **counts)
    pg_losses = -advantages * log_probs  # [batch, len]
    loss = weighted_aggregate(pg_losses, kept, agg or "token-mean", weights, counts)
    return loss, detached({"ppo_kl": masked_mean(old_log_probs - log_probs, kept)})


register_policy_loss("bypass_mode", bypass_mode_loss, params=("rollout_correction_settings",))
