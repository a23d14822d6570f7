"""Policy losses on the importance ratio other than PPO's clip, as VeRL registers them: sapo (a soft gate
in place of the clip), geo_mean (GMPO: the geometric mean of the token ratios), clip_cov and kl_cov (the
covariance-based entropy controls of Cui et al. 2025).

Call form: registry.py's policy loss form (old_log_probs, log_probs, advantages, mask [batch, len], the
clip settings, agg, rollout_is_weights, the aggregation counts as **counts, and the loss's own params).
"""

import torch

from .losses import aggregate_loss, detached, weighted_aggregate
from .registry import register_policy_loss
from .stats import EPS, masked_mean


def sapo_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
              agg=None, rollout_is_weights=None, tau_pos=1.0, tau_neg=1.05, **counts):
    """SAPO (arXiv 2511.20347): -f(ratio) * A with the soft gate f(r) = sigmoid(tau * (r - 1)) * 4 / tau,
    tau = tau_pos where A > 0 and tau_neg elsewhere, in place of a hard clip. Aggregated seq-mean-token-mean
    whatever `agg` says, as VeRL does; pg_clipfrac and pg_clipfrac_lower are 0."""
    neg_approx_kl = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)  # [batch, len]
    ratio = torch.exp(neg_approx_kl)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = weighted_aggregate(-gate * advantages, mask, "seq-mean-token-mean", rollout_is_weights, counts)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    return loss, detached({"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": masked_mean(-neg_approx_kl, mask)})


def geo_mean_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                  agg=None, rollout_is_weights=None, **counts):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the sequence's ratio is the geometric mean of its token
    ratios, each token's log-ratio clipped to [-clip_low, clip_high] on the side its advantage pushes
    (sign(A) * min(sign(A) * d, sign(A) * clip(d))); the loss of a sequence is -mean_t(A) * that ratio,
    averaged over the sequences (`agg` is unused). Rollout IS weights enter as their geometric mean over
    the sequence. Sequences with no valid token do not count in the average (VeRL's torch.mean counts them
    with loss 0). pg_clipfrac / pg_clipfrac_lower: tokens clipped with A > 0 / A < 0."""
    mask_f = mask.to(log_probs.dtype)
    neg_approx_kl = log_probs - old_log_probs  # [batch, len]
    clipped = torch.clamp(neg_approx_kl, -clip_low, clip_high)
    sign = torch.sign(advantages)
    kept = sign * torch.minimum(sign * neg_approx_kl, sign * clipped)  # [batch, len]
    lengths = mask_f.sum(dim=-1) + EPS  # [batch]
    seq_ratio = torch.exp((kept * mask_f).sum(dim=-1) / lengths)  # [batch]
    seq_advantage = (advantages * mask_f).sum(dim=-1) / lengths  # [batch]
    seq_losses = -seq_advantage * seq_ratio  # [batch]
    if rollout_is_weights is not None:
        seq_losses = seq_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask_f).sum(dim=-1) / lengths)
    has_tokens = (mask_f.sum(dim=-1, keepdim=True) > 0).to(log_probs.dtype)  # [batch, 1]
    counts.pop("global_token_count", None)
    counts.pop("scale_factor", None)
    loss = aggregate_loss(seq_losses.unsqueeze(-1), has_tokens, "seq-mean-token-sum", **counts)
    was_clipped = (neg_approx_kl != clipped).to(log_probs.dtype)
    return loss, detached({
        "pg_clipfrac": masked_mean(was_clipped * (advantages > 0), mask),
        "pg_clipfrac_lower": masked_mean(was_clipped * (advantages < 0), mask),
        "ppo_kl": masked_mean(-neg_approx_kl, mask),
    })


def clip_cov_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                  agg=None, rollout_is_weights=None, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
                  **counts):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's clipped surrogate (no dual clip, no log-ratio
    clamp), with the gradient of a few tokens cut: among the valid tokens PPO did not clip whose
    covariance (A - mean A) * (log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub), max(1,
    int(clip_cov_ratio * valid tokens)) are drawn at random (torch.randperm, the global generator) and
    their loss set to 0. pg_clipfrac: the fraction cut."""
    valid = mask > 0
    neg_approx_kl = log_probs - old_log_probs  # [batch, len]
    ratio = torch.exp(neg_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, mask)) * (log_probs - masked_mean(log_probs, mask))
        candidates = (cov > clip_cov_lb) & (cov < clip_cov_ub) & valid & ~(pg_losses2 > pg_losses1)
        positions = torch.nonzero(candidates)  # [n, 2], row-major order
        n_cut = max(int(clip_cov_ratio * mask.sum().item()), 1)
        keep = torch.ones_like(advantages)
        if len(positions) > 0:
            chosen = positions[torch.randperm(len(positions))[:n_cut]]
            keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep  # [batch, len]
    loss = weighted_aggregate(pg_losses, mask, agg or "token-mean", rollout_is_weights, counts)
    return loss, detached({"pg_clipfrac": masked_mean((keep == 0).to(log_probs.dtype), mask),
                           "ppo_kl": masked_mean(-neg_approx_kl, mask)})


def kl_cov_loss(old_log_probs, log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                agg=None, rollout_is_weights=None, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, **counts):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate -A * ratio, plus ppo_kl_coef *
    |log ratio| on the max(1, int(kl_cov_ratio * valid tokens)) valid tokens of largest covariance
    (A - mean A) * (log pi - mean log pi). The clip settings are unused. ppo_kl: the mean |log ratio|, as
    VeRL reports it."""
    neg_approx_kl = log_probs - old_log_probs  # [batch, len]
    abs_kl = neg_approx_kl.abs()
    ratio = torch.exp(neg_approx_kl)
    pg_losses = -advantages * ratio  # [batch, len]
    with torch.no_grad():
        valid = (mask > 0).reshape(-1)
        penalised = torch.zeros_like(valid)  # [batch * len]
        if valid.any():
            flat = torch.nonzero(valid).squeeze(-1)  # [n] positions of the valid tokens, row-major
            adv, logp = advantages.reshape(-1)[flat], log_probs.reshape(-1)[flat]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(flat) * kl_cov_ratio))).indices
            penalised[flat[top]] = True
    pg_losses = torch.where(penalised.reshape(mask.shape), pg_losses + ppo_kl_coef * abs_kl, pg_losses)
    loss = weighted_aggregate(pg_losses, mask, agg or "token-mean", rollout_is_weights, counts)
    return loss, detached({"ppo_kl": masked_mean(abs_kl, mask)})


register_policy_loss("sapo", sapo_loss, params=("tau_pos", "tau_neg"))
register_policy_loss("geo_mean", geo_mean_loss)
register_policy_loss("clip_cov", clip_cov_loss, params=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
register_policy_loss("kl_cov", kl_cov_loss, params=("kl_cov_ratio", "ppo_kl_coef"))
