"""Advantage estimators: GAE (PPO), GRPO, RLOO, REINFORCE++, ReMax, and VeRL's outcome variants: GRPO
pass@k, REINFORCE++ with a group baseline, OPO, GPG and GDPO.

Every estimator takes per-token rewards `token_rewards` [batch, response_len] (the outcome score usually
sits on the last valid token) and the response mask, and returns (advantages, returns), both
[batch, response_len]. They run under torch.no_grad(): advantages and returns are targets, not outputs
to differentiate.

The registry adapters at the bottom give all of them one keyword call form (see registry.py).
"""

import torch

from ._checks import check_2d, check_group_ids, check_per_row, check_same_shape
from .registry import register_advantage_estimator
from .stats import group_index, group_reduce, group_sum, masked_whiten


def _check_rewards(fn: str, token_rewards: torch.Tensor, mask: torch.Tensor) -> None:
    check_2d(fn, "token_rewards", token_rewards)
    check_same_shape(fn, "mask", mask, "token_rewards", token_rewards)


def _row_group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's group mean, unbiased group std (as torch.std) and group size, all [batch]; a group of one
    has mean 0 and std 1, as VeRL's group baselines take it."""
    inverse, counts = group_index(group_ids)  # [batch], [groups]
    n_groups = counts.numel()
    counts = counts.to(scores.dtype)
    mean = group_sum(scores, inverse, n_groups) / counts  # [groups]
    sq_dev = group_sum((scores - mean[inverse]) ** 2, inverse, n_groups)  # [groups]
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))  # [groups]
    size = counts[inverse]  # [batch]
    single = size == 1
    row_mean = torch.where(single, torch.zeros_like(scores), mean[inverse])
    row_std = torch.where(single, torch.ones_like(scores), std[inverse])
    return row_mean, row_std, size


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), walking the response backwards.

    Padding (mask 0) carries the next value and the running advantage through unchanged.
    returns = advantages + values before whitening; advantages are then masked-whitened.
    """
    _check_rewards("compute_gae", token_rewards, mask)
    check_same_shape("compute_gae", "values", values, "token_rewards", token_rewards)
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        batch, response_len = token_rewards.shape
        next_values = torch.zeros(batch, dtype=token_rewards.dtype, device=token_rewards.device)  # [batch]
        last_gae_lam = torch.zeros_like(next_values)  # [batch]
        advantages_reversed = []
        for t in reversed(range(response_len)):
            m_t = mask[:, t]
            delta = token_rewards[:, t] + gamma * next_values - values[:, t]
            gae_t = delta + gamma * lam * last_gae_lam
            next_values = values[:, t] * m_t + (1 - m_t) * next_values
            last_gae_lam = gae_t * m_t + (1 - m_t) * last_gae_lam
            advantages_reversed.append(last_gae_lam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)  # [batch, response_len]
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def compute_grpo_advantage(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): each response's score minus its group mean, over the group std.

    The score is the sum of the row's token rewards. A group of one has mean 0 and std 1.
    norm_by_std=False gives Dr.GRPO (no division by the std). returns = advantages.
    """
    _check_rewards("compute_grpo_advantage", token_rewards, mask)
    check_group_ids("compute_grpo_advantage", group_ids, token_rewards.shape[0])
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [batch]
        row_mean, row_std, _ = _row_group_stats(scores, group_ids)
        if norm_by_std:
            scores = (scores - row_mean) / (row_std + epsilon)
        else:
            scores = scores - row_mean
        advantages = scores.unsqueeze(-1) * mask.to(scores.dtype)  # [batch, response_len]
    return advantages, advantages


def compute_rloo_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, single_keeps_score: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): score minus the mean of the other group members.

    For a group of n > 1 this is s_i*n/(n-1) - mean*n/(n-1); a group of one keeps its score, or gets 0
    with single_keeps_score=False (VeRL's rloo_vectorized). returns = advantages.
    """
    _check_rewards("compute_rloo_advantage", token_rewards, mask)
    check_group_ids("compute_rloo_advantage", group_ids, token_rewards.shape[0])
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [batch]
        inverse, counts = group_index(group_ids)
        counts = counts.to(scores.dtype)
        mean = (group_sum(scores, inverse, counts.numel()) / counts)[inverse]  # [batch]
        n = counts[inverse]  # [batch]
        scale = n / (n - 1).clamp(min=1)
        loo = scores * scale - mean * scale
        scores = torch.where(n > 1, loo, scores if single_keeps_score else torch.zeros_like(scores))
        advantages = scores.unsqueeze(-1) * mask.to(scores.dtype)  # [batch, response_len]
    return advantages, advantages


def compute_reinforce_pp_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the whole batch.

    Padding carries the running return through unchanged. returns = G; advantages = whiten(G) * mask.
    """
    _check_rewards("compute_reinforce_pp_advantage", token_rewards, mask)
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        returns = torch.zeros_like(token_rewards)  # [batch, response_len]
        running = torch.zeros_like(token_rewards[:, 0])  # [batch]
        for t in reversed(range(token_rewards.shape[1])):
            m_t = mask[:, t]
            new = token_rewards[:, t] + gamma * running
            returns[:, t] = new * m_t
            running = new * m_t + running * (1 - m_t)
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def compute_remax_advantage(
    token_rewards: torch.Tensor, baselines: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the greedy response's reward for the same prompt.

    `baselines` [batch] is the score of the greedy sample of each row's prompt.
    """
    _check_rewards("compute_remax_advantage", token_rewards, mask)
    check_per_row("compute_remax_advantage", "baselines", baselines, token_rewards.shape[0])
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        returns = (token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])  # [batch, len]
        advantages = returns - baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


def compute_grpo_passk_advantage(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (Chen et al. 2025, arXiv 2503.19595): only the best response of each group learns,
    from its lead over the runner-up, s_max - s_second (over the group's std + epsilon with norm_by_std);
    every other response gets 0, and so does a tie at the top.

    A group of one (the others' scoring failed) gets 0; VeRL refuses such a batch. returns = advantages.
    """
    _check_rewards("compute_grpo_passk_advantage", token_rewards, mask)
    check_group_ids("compute_grpo_passk_advantage", group_ids, token_rewards.shape[0])
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [batch]
        _, row_std, size = _row_group_stats(scores, group_ids)
        inverse, counts = group_index(group_ids)
        n_groups = counts.numel()
        rows = torch.arange(scores.shape[0], device=scores.device)  # [batch]
        top = group_reduce(scores, inverse, n_groups, "amax")[inverse]  # [batch]
        first_top = group_reduce(torch.where(scores == top, rows, scores.shape[0]), inverse, n_groups, "amin")
        best = rows == first_top[inverse]  # [batch], one row per group
        runner_up = group_reduce(scores.masked_fill(best, -torch.inf), inverse, n_groups, "amax")[inverse]
        lead = top - runner_up
        if norm_by_std:
            lead = lead / (row_std + epsilon)
        scores = torch.where(best & (size > 1), lead, torch.zeros_like(scores))
        advantages = scores.unsqueeze(-1) * mask.to(scores.dtype)  # [batch, response_len]
    return advantages, advantages


def compute_reinforce_pp_baseline_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv 2501.03262, "REINFORCE++-baseline"): each
    response's score minus its group's mean (a group of one: mean 0) on every response token, whitened
    over the whole batch. returns = advantages.
    """
    _check_rewards("compute_reinforce_pp_baseline_advantage", token_rewards, mask)
    check_group_ids("compute_reinforce_pp_baseline_advantage", group_ids, token_rewards.shape[0])
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [batch]
        row_mean, _, _ = _row_group_stats(scores, group_ids)
        mask = mask.to(scores.dtype)
        advantages = (scores - row_mean).unsqueeze(-1) * mask  # [batch, response_len]
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, advantages


def compute_opo_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv 2505.23585): each response's score minus its group's length-weighted
    mean score, sum_j |y_j| s_j / sum_j |y_j| with |y| the response's tokens (the optimal baseline of
    on-policy REINFORCE); a group of one, or of empty responses, has baseline 0. returns = advantages.
    """
    _check_rewards("compute_opo_advantage", token_rewards, mask)
    check_group_ids("compute_opo_advantage", group_ids, token_rewards.shape[0])
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [batch]
        lengths = mask.to(scores.dtype).sum(dim=-1)  # [batch]
        inverse, counts = group_index(group_ids)
        weighted = group_sum(lengths * scores, inverse, counts.numel())  # [groups]
        total = group_sum(lengths, inverse, counts.numel())  # [groups]
        baseline = torch.where(total > 0, weighted / torch.where(total > 0, total, 1), 0)[inverse]  # [batch]
        baseline = torch.where(counts[inverse] > 1, baseline, torch.zeros_like(baseline))
        advantages = (scores - baseline).unsqueeze(-1) * mask.to(scores.dtype)  # [batch, response_len]
    return advantages, advantages


def compute_gpg_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): score minus the group mean (a group of one: mean 0), times
    alpha = batch size / number of responses with a non-zero score (at least 1), which makes up for the
    rows that teach nothing. No division by the std. returns = advantages.
    """
    _check_rewards("compute_gpg_advantage", token_rewards, mask)
    check_group_ids("compute_gpg_advantage", group_ids, token_rewards.shape[0])
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)  # [batch]
        row_mean, _, _ = _row_group_stats(scores, group_ids)
        alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
        advantages = (alpha * (scores - row_mean)).unsqueeze(-1) * mask.to(scores.dtype)  # [batch, len]
    return advantages, advantages


def compute_gdpo_advantage(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    reward_components: torch.Tensor | None = None,
    reward_weights: list[float] | None = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242): each reward component normalized within its group on its own, as GRPO
    normalizes the score (so that a dominant component does not drown the others), their weighted sum
    whitened over the batch.

    reward_components [batch, K] (None: the score alone, K = 1); reward_weights: K weights (None: 1 each).
    returns = advantages.
    """
    _check_rewards("compute_gdpo_advantage", token_rewards, mask)
    check_group_ids("compute_gdpo_advantage", group_ids, token_rewards.shape[0])
    if reward_components is None:
        reward_components = token_rewards.sum(dim=-1, keepdim=True)
    if reward_components.dim() != 2 or reward_components.shape[0] != token_rewards.shape[0]:
        raise ValueError(f"compute_gdpo_advantage: reward_components must be [{token_rewards.shape[0]}, K], got "
                         f"{tuple(reward_components.shape)}")
    weights = [1.0] * reward_components.shape[1] if reward_weights is None else list(reward_weights)
    if len(weights) != reward_components.shape[1]:
        raise ValueError(f"compute_gdpo_advantage: {len(weights)} reward_weights for {reward_components.shape[1]} "
                         "reward components")
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        total = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
        for weight, component in zip(weights, reward_components.to(token_rewards.dtype).unbind(-1), strict=True):
            row_mean, row_std, _ = _row_group_stats(component, group_ids)
            centred = component - row_mean
            total = total + weight * (centred / (row_std + epsilon) if norm_by_std else centred)
        advantages = masked_whiten(total.unsqueeze(-1) * mask, mask) * mask  # [batch, response_len]
    return advantages, advantages


# Registry adapters, in the uniform keyword call form of registry.py (ADVANTAGE_ESTIMATOR_KWARGS);
# each takes every keyword so a misspelt one fails, and ignores what its estimator does not need.


def _need(name: str, arg: str, value):
    if value is None:
        raise ValueError(f"advantage estimator {name!r} needs {arg}")
    return value


def _gae(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
         norm_by_std=True):
    return compute_gae(token_rewards, _need("gae", "values", values), mask, gamma=gamma, lam=lam)


def _grpo(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
          norm_by_std=True):
    group_ids = _need("grpo", "group_ids", group_ids)
    return compute_grpo_advantage(token_rewards, mask, group_ids, norm_by_std=norm_by_std)


def _rloo(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
          norm_by_std=True):
    return compute_rloo_advantage(token_rewards, mask, _need("rloo", "group_ids", group_ids))


def _reinforce_pp(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
                  norm_by_std=True):
    return compute_reinforce_pp_advantage(token_rewards, mask, gamma=gamma)


def _remax(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
           norm_by_std=True):
    return compute_remax_advantage(token_rewards, _need("remax", "baselines", baselines), mask)


def _rloo_vectorized(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
                     norm_by_std=True):
    group_ids = _need("rloo_vectorized", "group_ids", group_ids)
    return compute_rloo_advantage(token_rewards, mask, group_ids, single_keeps_score=False)


def _grpo_passk(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
                norm_by_std=True):
    group_ids = _need("grpo_passk", "group_ids", group_ids)
    return compute_grpo_passk_advantage(token_rewards, mask, group_ids, norm_by_std=norm_by_std)


def _reinforce_pp_baseline(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0,
                           lam=1.0, norm_by_std=True):
    group_ids = _need("reinforce_plus_plus_baseline", "group_ids", group_ids)
    return compute_reinforce_pp_baseline_advantage(token_rewards, mask, group_ids)


def _opo(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
         norm_by_std=True):
    return compute_opo_advantage(token_rewards, mask, _need("opo", "group_ids", group_ids))


def _gpg(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
         norm_by_std=True):
    return compute_gpg_advantage(token_rewards, mask, _need("gpg", "group_ids", group_ids))


def _gdpo(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
          norm_by_std=True, reward_components=None, gdpo_reward_weights=None):
    group_ids = _need("gdpo", "group_ids", group_ids)
    return compute_gdpo_advantage(token_rewards, mask, group_ids, reward_components, gdpo_reward_weights,
                                  norm_by_std=norm_by_std)


register_advantage_estimator("gae", _gae)
register_advantage_estimator("grpo", _grpo)
register_advantage_estimator("rloo", _rloo)
register_advantage_estimator("reinforce_plus_plus", _reinforce_pp)
register_advantage_estimator("remax", _remax)
# VeRL's vectorized GRPO is GRPO (its group statistics in float32); its vectorized RLOO gives a group of
# one 0 where rloo keeps the score.
register_advantage_estimator("grpo_vectorized", _grpo)
register_advantage_estimator("rloo_vectorized", _rloo_vectorized)
register_advantage_estimator("grpo_passk", _grpo_passk)
register_advantage_estimator("reinforce_plus_plus_baseline", _reinforce_pp_baseline)
register_advantage_estimator("opo", _opo)
register_advantage_estimator("gpg", _gpg)
register_advantage_estimator("gdpo", _gdpo, params=("gdpo_reward_weights",), inputs=("reward_components",))
