"""Rollout correction: the gap between the policy that sampled a batch (the rollout engine, pi_rollout)
and the trainer's policy (pi_old), measured and corrected (VeRL's rollout_corr; Liu, Li et al. 2025,
"When Speed Kills Stability").

The rollout engine and the trainer compute the same policy with different kernels, precisions and
sometimes weights one version apart, so the tokens were not sampled from pi_old. With the per-token
ratio r_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_log_probs - rollout_log_probs):

- truncated IS (TIS): each token's policy loss is multiplied by min(r_t, C) (token level) or by
  min(prod_t r_t, C) for every token of the sequence (sequence level);
- rejection (masked IS): tokens whose r_t, or whole sequences whose prod_t r_t, lie outside
  [lower, upper] are left out of the loss (their mask goes to 0).

Ratios are taken in log space and bounded to exp(+-20) before exponentiation, so a long sequence's
product cannot overflow. Per-token tensors are [batch, response_len]; `mask` is the response mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_2d, check_same_shape, unknown_name
from .stats import masked_mean

LEVELS = ("token", "sequence")
LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: the safety bound of every ratio, token or sequence


@dataclass
class RolloutCorrection:
    """What rollout_correction gives the policy update."""

    weights: torch.Tensor | None  # [B, T] IS weights, 0 on padding; None when rollout_is is off
    mask: torch.Tensor  # [B, T] the response mask with the rejected tokens at 0
    metrics: dict[str, float]  # rollout_corr/...


def mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs are from the rollout's, over the real tokens (VeRL's names):

    rollout_corr/kl               mean(rollout - old): the k1 estimate of KL(pi_rollout || pi_old)
    rollout_corr/k3_kl            mean(r - 1 - log r): the k3 estimate of the same KL (>= 0 per token)
    rollout_corr/log_ppl_diff     mean over sequences of log_ppl(rollout) - log_ppl(old)
    rollout_corr/log_ppl_abs_diff the same with absolute values
    rollout_corr/chi2_token       mean(r^2) - 1
    rollout_corr/log_prob_abs_diff  mean |old - rollout|: the per-token log-prob gap (MoE routing replay's measure)
    rollout_corr/rollout_is_{mean,min,max}  the token ratio r before any truncation
    """
    fn = "mismatch_metrics"
    check_2d(fn, "old_log_probs", old_log_probs)
    check_same_shape(fn, "rollout_log_probs", rollout_log_probs, "old_log_probs", old_log_probs)
    check_same_shape(fn, "mask", mask, "old_log_probs", old_log_probs)
    real = mask.bool()
    if not real.any():
        return {}
    log_ratio = _token_log_ratio(old_log_probs, rollout_log_probs, mask)  # [B, T]
    ratio = log_ratio.exp()
    has_tokens = real.any(-1)  # [B]
    seq_log_ppl_diff = masked_mean(log_ratio, mask, dim=-1)[has_tokens]  # [B'] log_ppl(rollout) - log_ppl(old)
    return {
        "rollout_corr/kl": masked_mean(-log_ratio, mask).item(),
        "rollout_corr/k3_kl": masked_mean(ratio - 1 - log_ratio, mask).item(),
        "rollout_corr/log_ppl_diff": seq_log_ppl_diff.mean().item(),
        "rollout_corr/log_ppl_abs_diff": seq_log_ppl_diff.abs().mean().item(),
        "rollout_corr/chi2_token": (masked_mean(ratio**2, mask) - 1).item(),
        "rollout_corr/log_prob_abs_diff": masked_mean(log_ratio.abs(), mask).item(),
        "rollout_corr/rollout_is_mean": masked_mean(ratio, mask).item(),
        "rollout_corr/rollout_is_min": ratio[real].min().item(),
        "rollout_corr/rollout_is_max": ratio[real].max().item(),
    }


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
) -> RolloutCorrection:
    """IS weights (rollout_is "token" / "sequence", truncated at rollout_is_threshold), the response mask
    after rejection (rollout_rs "token" / "sequence": ratios outside [rollout_rs_threshold_lower, default
    1 / rollout_rs_threshold, rollout_rs_threshold] rejected), and the metrics: mismatch_metrics plus

    rollout_corr/rollout_is_ratio_fraction_high  real tokens whose weight was truncated (IS on)
    rollout_corr/rollout_is_weights_mean         mean weight after truncation (IS on)
    rollout_corr/rollout_is_seq_{mean,min,max}   the sequence ratio prod_t r_t (a sequence level on)
    rollout_corr/rollout_rs_masked_fraction      real tokens rejected (RS on)
    rollout_corr/rollout_rs_seq_masked_fraction  sequences with at least one token rejected (RS on)

    Either level None leaves that part off: rollout_correction(old, rollout, mask) gives the metrics,
    weights None and the mask unchanged.
    """
    fn = "rollout_correction"
    for key, level in (("rollout_is", rollout_is), ("rollout_rs", rollout_rs)):
        if level is not None and level not in LEVELS:
            raise unknown_name(fn, key, level, LEVELS)
    lower = 1.0 / rollout_rs_threshold if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
    if rollout_is is not None and rollout_is_threshold <= 0:
        raise ValueError(f"{fn}: rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    if rollout_rs is not None and not 0 <= lower < rollout_rs_threshold:
        raise ValueError(f"{fn}: the rejection bounds must satisfy 0 <= lower < upper, got "
                         f"[{lower}, {rollout_rs_threshold}]")
    metrics = mismatch_metrics(old_log_probs, rollout_log_probs, mask)
    real = mask.bool()
    log_ratio = _token_log_ratio(old_log_probs, rollout_log_probs, mask)  # [B, T]
    mask_f = mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio.sum(-1)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B] log prod_t r_t
    has_tokens = real.any(-1)  # [B]
    if "sequence" in (rollout_is, rollout_rs) and has_tokens.any():
        seq_ratio = seq_log_ratio[has_tokens].exp()
        metrics.update({"rollout_corr/rollout_is_seq_mean": seq_ratio.mean().item(),
                        "rollout_corr/rollout_is_seq_min": seq_ratio.min().item(),
                        "rollout_corr/rollout_is_seq_max": seq_ratio.max().item()})

    def level_ratio(level: str) -> torch.Tensor:  # [B, T] each token's own ratio, or its sequence's
        return (log_ratio if level == "token" else seq_log_ratio.unsqueeze(-1).expand_as(log_ratio)).exp()

    weights = None
    if rollout_is is not None:
        ratio = level_ratio(rollout_is)
        weights = ratio.clamp(max=rollout_is_threshold) * mask_f  # [B, T]
        metrics["rollout_corr/rollout_is_ratio_fraction_high"] = masked_mean(
            (ratio > rollout_is_threshold).to(mask_f.dtype), mask_f).item()
        metrics["rollout_corr/rollout_is_weights_mean"] = masked_mean(weights, mask_f).item()
    kept = mask
    if rollout_rs is not None:
        ratio = level_ratio(rollout_rs)
        rejected = real & ((ratio < lower) | (ratio > rollout_rs_threshold))  # [B, T]
        kept = mask.masked_fill(rejected, 0)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(rejected.to(mask_f.dtype), mask_f).item()
        sequences = max(int(has_tokens.sum()), 1)
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(rejected.any(-1).sum()) / sequences
    return RolloutCorrection(weights=weights, mask=kept, metrics=metrics)


def _token_log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """log r_t = old - rollout, bounded to +-20, 0 on padding: [B, T] float32 (float64 for float64 inputs)."""
    dtype = torch.promote_types(torch.promote_types(old_log_probs.dtype, rollout_log_probs.dtype), torch.float32)
    log_ratio = (old_log_probs.to(dtype) - rollout_log_probs.to(dtype)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(mask.bool(), log_ratio, 0.0)
