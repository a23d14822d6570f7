"""Advantage estimators: GAE (PPO), GRPO, RLOO, REINFORCE++ and ReMax.

Every estimator takes per-token rewards `token_rewards` [batch, response_len] (the outcome score usually
sits on the last valid token) and the response mask, and returns (advantages, returns), both
[batch, response_len]. They run under torch.no_grad(): advantages and returns are targets, not outputs
to differentiate.

The registry adapters at the bottom give all of them one keyword call form (see registry.py).
"""

import torch

from ._checks import check_2d, check_group_ids, check_per_row, check_same_shape
from .registry import register_advantage_estimator
from .stats import group_index, group_sum, masked_whiten


def _check_rewards(fn: str, token_rewards: torch.Tensor, mask: torch.Tensor) -> None:
    check_2d(fn, "token_rewards", token_rewards)
    check_same_shape(fn, "mask", mask, "token_rewards", token_rewards)


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
        inverse, counts = group_index(group_ids)  # [batch], [groups]
        n_groups = counts.numel()
        counts = counts.to(scores.dtype)
        mean = group_sum(scores, inverse, n_groups) / counts  # [groups]
        sq_dev = group_sum((scores - mean[inverse]) ** 2, inverse, n_groups)  # [groups]
        std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))  # [groups], unbiased like torch.std
        single = counts[inverse] == 1  # [batch]
        row_mean = torch.where(single, torch.zeros_like(scores), mean[inverse])
        row_std = torch.where(single, torch.ones_like(scores), std[inverse])
        if norm_by_std:
            scores = (scores - row_mean) / (row_std + epsilon)
        else:
            scores = scores - row_mean
        advantages = scores.unsqueeze(-1) * mask.to(scores.dtype)  # [batch, response_len]
    return advantages, advantages


def compute_rloo_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): score minus the mean of the other group members.

    For a group of n > 1 this is s_i*n/(n-1) - mean*n/(n-1); a group of one keeps its score.
    returns = advantages.
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
        scores = torch.where(n > 1, loo, scores)
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


register_advantage_estimator("gae", _gae)
register_advantage_estimator("grpo", _grpo)
register_advantage_estimator("rloo", _rloo)
register_advantage_estimator("reinforce_plus_plus", _reinforce_pp)
register_advantage_estimator("remax", _remax)
