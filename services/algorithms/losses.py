"""Loss aggregation, the PPO clipped policy loss (vanilla and GSPO), the policy loss dispatcher and the
clipped value loss. VeRL's other policy losses are in reinforce_losses.py and surrogate_losses.py.

Per-token tensors are [batch, response_len]; `mask` is the response mask. Losses come back as 0-dim
tensors with their graph; stats are dicts of detached 0-dim tensors (no device sync: call .item() when
logging). An all-zero mask gives a loss of 0, not NaN.
"""

import torch

from ._checks import check_2d, check_same_shape, unknown_name
from .registry import get_policy_loss, register_policy_loss
from .stats import EPS, masked_mean

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_count(fn: str, name: str, value, allow_zero: bool) -> None:
    # Tensors (e.g. an all-reduced count on the GPU) are not checked, to avoid a device sync.
    if isinstance(value, (int, float)) and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{fn}: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_token_count: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [batch, response_len] to a scalar.

    - token-mean: sum(L*m) / (token count + 1e-8). With data parallelism pass `global_token_count`
      (valid tokens summed over all ranks): summing the per-rank losses then gives the
      single-process loss.
    - seq-mean-token-sum: mean over sequences of sum_t(L*m).
    - seq-mean-token-mean: mean over sequences of sum_t(L*m) / (sum_t m + 1e-8).
    - seq-mean-token-sum-norm (Dr.GRPO): seq-mean-token-sum / scale_factor (default: the padded
      response length, loss_mat.shape[-1]).
    Sequence means count only sequences with at least one valid token; `global_seq_count` (valid
    sequences over all ranks) plays the part of global_token_count for them. Arguments a mode does not
    use are ignored, so a trainer may always pass both counts.
    """
    fn = "aggregate_loss"
    check_2d(fn, "loss_mat", loss_mat)
    check_same_shape(fn, "mask", mask, "loss_mat", loss_mat)
    if mode not in AGG_MODES:
        raise unknown_name(fn, "mode", mode, AGG_MODES)
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(dim=-1)  # [batch]
    if mode == "token-mean":
        _check_count(fn, "global_token_count", global_token_count, allow_zero=True)
        n_tokens = mask.sum() if global_token_count is None else global_token_count
        return token_sums.sum() / (n_tokens + EPS)

    token_counts = mask.sum(dim=-1)  # [batch]
    seq_valid = (token_counts > 0).to(loss_mat.dtype)  # [batch]
    if mode == "seq-mean-token-mean":
        seq_losses = token_sums / (token_counts + EPS)
    else:
        seq_losses = token_sums
    _check_count(fn, "global_seq_count", global_seq_count, allow_zero=False)
    n_seqs = seq_valid.sum().clamp(min=1) if global_seq_count is None else global_seq_count
    loss = (seq_losses * seq_valid).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        _check_count(fn, "scale_factor", scale_factor, allow_zero=False)
        loss = loss / (loss_mat.shape[-1] if scale_factor is None else scale_factor)
    return loss


def weighted_aggregate(
    pg_losses: torch.Tensor,
    mask: torch.Tensor,
    agg: str,
    rollout_is_weights: torch.Tensor | None,
    counts: dict,
) -> torch.Tensor:
    """aggregate_loss of the per-token policy loss [batch, len], each token's first multiplied by its
    rollout_is_weights (when given); `counts`: aggregate_loss's global_token_count, global_seq_count and
    scale_factor."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return aggregate_loss(pg_losses, mask, agg, **counts)


def detached(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach() for name, value in stats.items()}


def ppo_clip_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg: str | None = None,
    global_token_count=None,
    global_seq_count=None,
    scale_factor=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with the dual clip (Ye et al. 2020) for A < 0.

    The ratio is clipped to [1 - clip_low, 1 + clip_high] (decoupled, as DAPO's clip-higher); for
    negative advantages the loss is further capped at -A * clip_ratio_c. agg None means token-mean.
    rollout_is_weights [batch, len] (rollout correction) multiply each token's clipped loss.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"ppo_clip_loss: clip_ratio_c must be > 1, got {clip_ratio_c}")
    neg_approx_kl = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)  # [batch, len]
    ratio = torch.exp(neg_approx_kl)
    ppo_kl = masked_mean(-neg_approx_kl, mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(log_probs.dtype), mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    lower_clipped = (clip_pg_losses1 > pg_losses3) & (advantages < 0)
    pg_clipfrac_lower = masked_mean(lower_clipped.to(log_probs.dtype), mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)  # [batch, len]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = aggregate_loss(
        pg_losses, mask, agg or "token-mean",
        global_token_count=global_token_count, scale_factor=scale_factor, global_seq_count=global_seq_count,
    )
    stats = {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}
    return loss, {k: v.detach() for k, v in stats.items()}


def gspo_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg: str | None = None,
    global_token_count=None,
    global_seq_count=None,
    scale_factor=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): the PPO clip on a sequence-level ratio, the geometric mean of the
    token ratios, with each token's gradient flowing through its own log-prob.

    No dual clip (clip_ratio_c is unused; pg_clipfrac_lower is 0). agg None means seq-mean-token-mean,
    as in the paper. rollout_is_weights [batch, len] multiply each token's clipped loss.
    """
    neg_approx_kl = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)  # [batch, len]
    mask_f = mask.to(log_probs.dtype)
    seq_lengths = mask_f.sum(dim=-1).clamp(min=1)  # [batch]
    seq_neg_kl = (neg_approx_kl * mask_f).sum(dim=-1) / seq_lengths  # [batch], log s_i
    # value log s_i on every token, gradient d log pi_t
    log_seq_ratio = log_probs - log_probs.detach() + seq_neg_kl.detach().unsqueeze(-1)  # [batch, len]
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)  # [batch, len]
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(log_probs.dtype), mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = aggregate_loss(
        pg_losses, mask, agg or "seq-mean-token-mean",
        global_token_count=global_token_count, scale_factor=scale_factor, global_seq_count=global_seq_count,
    )
    stats = {
        "pg_clipfrac": pg_clipfrac,
        "pg_clipfrac_lower": torch.zeros((), dtype=log_probs.dtype, device=log_probs.device),
        "ppo_kl": masked_mean(-neg_approx_kl, mask),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg: str | None = None,
    mode: str = "vanilla",
    *,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **params,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of the registered `mode` ("vanilla" PPO clip, "gspo", VeRL's others, or your own).

    All per-token inputs are [batch, response_len]. `agg` None picks the mode's own default
    (vanilla: token-mean, gspo: seq-mean-token-mean); the count arguments go to aggregate_loss.
    rollout_is_weights (rollout correction's truncated IS weights, or None) multiply the per-token
    policy loss before aggregation. `params`: the mode's own settings (registry.policy_loss_params, e.g.
    clip_cov_ratio for clip_cov).
    Returns (loss, stats), stats detached 0-dim tensors: `pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl`
    for most modes.
    """
    fn = "policy_loss"
    check_2d(fn, "log_probs", log_probs)
    check_same_shape(fn, "old_log_probs", old_log_probs, "log_probs", log_probs)
    check_same_shape(fn, "advantages", advantages, "log_probs", log_probs)
    check_same_shape(fn, "mask", mask, "log_probs", log_probs)
    if rollout_is_weights is not None:
        check_same_shape(fn, "rollout_is_weights", rollout_is_weights, "log_probs", log_probs)
    loss_fn = get_policy_loss(mode)
    return loss_fn(
        old_log_probs, log_probs, advantages, mask,
        clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, agg=agg,
        global_token_count=global_token_count, global_seq_count=global_seq_count, scale_factor=scale_factor,
        rollout_is_weights=rollout_is_weights, **params,
    )


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.5,
    agg: str = "token-mean",
    *,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * aggregate(max((V - R)^2, (V_clip - R)^2)), V_clip within
    old_values +- clip_range.

    Returns (loss, stats) with stats `vf_clipfrac` and `vpred_mean` as detached 0-dim tensors.
    """
    fn = "value_loss"
    check_2d(fn, "values", values)
    check_same_shape(fn, "returns", returns, "values", values)
    check_same_shape(fn, "old_values", old_values, "values", values)
    check_same_shape(fn, "mask", mask, "values", values)
    if clip_range < 0:
        raise ValueError(f"value_loss: clip_range must be >= 0, got {clip_range}")
    values_clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)  # [batch, len]
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (values_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(
        torch.maximum(vf_losses1, vf_losses2), mask, agg,
        global_token_count=global_token_count, scale_factor=scale_factor, global_seq_count=global_seq_count,
    )
    stats = {
        "vf_clipfrac": masked_mean((vf_losses2 > vf_losses1).to(values.dtype), mask),
        "vpred_mean": masked_mean(values, mask),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


register_policy_loss("vanilla", ppo_clip_loss)
register_policy_loss("gspo", gspo_loss)
