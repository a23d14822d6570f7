"""Policy losses of the REINFORCE form, -A * w * log pi, as VeRL registers them: gpg, cispo, dppo_tv,
dppo_kl and dro. The weight w is a detached function of the ratio (or 1), so each token's gradient is
A * w * d log pi, and a token the weight keeps never loses its gradient the way PPO's clip drops it.

Call form: registry.py's policy loss form (old_log_probs, log_probs, advantages, mask [batch, len], the
clip settings, agg, rollout_is_weights, and the aggregation counts as **counts); agg None is token-mean.
"""

import torch

from .losses import detached, weighted_aggregate
from .registry import register_policy_loss
from .stats import masked_mean


def _ratio(old_log_probs: torch.Tensor, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-ratio clamped to [-20, 20], ratio), both [batch, len]."""
    neg_approx_kl = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)
    return neg_approx_kl, torch.exp(neg_approx_kl)


def gpg_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
             agg=None, rollout_is_weights=None, **counts):
    """GPG (Chu et al. 2025): plain policy gradient, -A * log pi, no ratio and no clip (the clip settings
    are unused). Stats: ppo_kl only (VeRL's reports none)."""
    pg_losses = -advantages * log_probs  # [batch, len]
    loss = weighted_aggregate(pg_losses, mask, agg or "token-mean", rollout_is_weights, counts)
    return loss, detached({"ppo_kl": masked_mean(old_log_probs - log_probs, mask)})


def cispo_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
               agg=None, rollout_is_weights=None, **counts):
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log pi, so a clipped
    token keeps its gradient, only smaller. pg_clipfrac: tokens whose ratio was clipped; no dual clip."""
    neg_approx_kl, ratio = _ratio(old_log_probs, log_probs)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = -clipped.detach() * advantages * log_probs  # [batch, len]
    loss = weighted_aggregate(pg_losses, mask, agg or "token-mean", rollout_is_weights, counts)
    return loss, detached({
        "pg_clipfrac": masked_mean((ratio != clipped).to(log_probs.dtype), mask),
        "pg_clipfrac_lower": torch.zeros((), dtype=log_probs.dtype, device=log_probs.device),
        "ppo_kl": masked_mean(-neg_approx_kl, mask),
    })


def _dppo_loss(old_log_probs, log_probs, advantages, mask, trusted, clip_ratio_c, agg, rollout_is_weights,
               counts):
    """DPPO's common part: -A * sg(min(ratio, clip_ratio_c)) * log pi on the tokens `trusted` [batch, len]
    (bool) keeps. pg_clipfrac: tokens dropped; pg_clipfrac_lower: kept tokens whose ratio was truncated."""
    neg_approx_kl, ratio = _ratio(old_log_probs, log_probs)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    keep = trusted.detach().to(log_probs.dtype)
    pg_losses = -advantages * truncated * log_probs * keep  # [batch, len]
    loss = weighted_aggregate(pg_losses, mask, agg or "token-mean", rollout_is_weights, counts)
    return loss, detached({
        "pg_clipfrac": masked_mean(1.0 - keep, mask),
        "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).to(log_probs.dtype) * keep, mask),
        "ppo_kl": masked_mean(-neg_approx_kl, mask),
    })


def dppo_tv_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                 agg=None, rollout_is_weights=None, **counts):
    """DPPO-Binary-TV (arXiv 2602.04879): a token learns while the change of its probability stays within
    the trust region in the direction its advantage pushes, p - p_old <= clip_high for A > 0 and
    p - p_old >= -clip_low otherwise (clip_low/high are total-variation bounds here, not ratio bounds);
    its weight is the ratio truncated at clip_ratio_c (truncated IS, in place of PPO's dual clip; the
    paper advises a large one, e.g. 20)."""
    change = torch.exp(log_probs) - torch.exp(old_log_probs)  # [batch, len]
    trusted = torch.where(advantages > 0, change <= clip_high, change >= -clip_low)
    return _dppo_loss(old_log_probs, log_probs, advantages, mask, trusted, clip_ratio_c, agg or "token-mean",
                      rollout_is_weights, counts)


def dppo_kl_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                 agg=None, rollout_is_weights=None, **counts):
    """DPPO-Binary-KL (arXiv 2602.04879): as dppo_tv, the trust region measured by the KL between the
    token's old and new Bernoulli (p_old, p): KL = p_old log(p_old/p) + (1 - p_old) log((1 - p_old + 1e-8)
    / (1 - p + 1e-8)); a token moving against its advantage's push is always kept."""
    prob, old_prob = torch.exp(log_probs), torch.exp(old_log_probs)
    binary_kl = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))  # [batch, len]
    trusted = torch.where(advantages > 0, (binary_kl <= clip_high) | (prob <= old_prob),
                          (binary_kl <= clip_low) | (prob >= old_prob))
    return _dppo_loss(old_log_probs, log_probs, advantages, mask, trusted, clip_ratio_c, agg or "token-mean",
                      rollout_is_weights, counts)


def dro_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
             agg=None, rollout_is_weights=None, dro_beta=None, **counts):
    """DRO, Direct Reward Optimization (Richemond et al. 2024): -(A * log pi - dro_beta / 2 * (log pi -
    log pi_old)^2), a policy gradient with a quadratic penalty on the log-ratio; dro_beta > 0 is needed."""
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"dro_loss: dro_beta must be > 0 (actor.dro_beta), got {dro_beta}")
    log_ratio = log_probs - old_log_probs  # [batch, len]
    pg_losses = -(log_probs * advantages - 0.5 * dro_beta * log_ratio.square())
    loss = weighted_aggregate(pg_losses, mask, agg or "token-mean", rollout_is_weights, counts)
    return loss, detached({"ppo_kl": masked_mean(-log_ratio, mask)})


register_policy_loss("gpg", gpg_loss)
register_policy_loss("cispo", cispo_loss)
register_policy_loss("dppo_tv", dppo_tv_loss)
register_policy_loss("dppo_kl", dppo_kl_loss)
register_policy_loss("dro", dro_loss, params=("dro_beta",))
