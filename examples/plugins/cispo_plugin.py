"""An algorithm plugin (algorithm.plugin_modules): a policy loss and an advantage estimator registered
without editing rlfabric. Put this folder on the services' import path and name the module in the
mesh's config:

    PYTHONPATH=examples/plugins rlfabric train algorithm.plugin_modules=[cispo_plugin] \\
        actor.loss_mode=cispo algorithm.adv_estimator=group_rank

- "cispo" (MiniMax-M1, 2025): REINFORCE on each token's log-prob, weighted by its importance ratio
  clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] and detached, so a clipped token still has a
  gradient (PPO's clip drops it). Reports actor/cispo_clipfrac.
- "group_rank": each sample's advantage is its score's rank within its prompt's group, centred and
  scaled to [-1, 1] (ties share their mean rank); a group of one gets 0.

CALLS counts the calls of each in this process (the tests read it).
"""

from __future__ import annotations

import torch

from rlfabric import algorithms as algos

CALLS = {"cispo": 0, "group_rank": 0}


def cispo_loss(old_log_probs, log_probs, advantages, mask, *, clip_low, clip_high, clip_ratio_c, agg,
               global_token_count, global_seq_count, scale_factor, rollout_is_weights):
    """The registry's policy loss call form (rlfabric.algorithms.registry); clip_ratio_c is unused."""
    CALLS["cispo"] += 1
    ratio = torch.exp(torch.clamp(log_probs - old_log_probs, -20.0, 20.0))  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    pg_losses = -advantages * clipped * log_probs  # [B, T]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = algos.aggregate_loss(pg_losses, mask, agg or "token-mean", global_token_count=global_token_count,
                                global_seq_count=global_seq_count, scale_factor=scale_factor)
    clipfrac = algos.masked_mean((ratio.detach() != clipped).to(log_probs.dtype), mask)
    stats = {"pg_clipfrac": clipfrac, "cispo_clipfrac": clipfrac,
             "pg_clipfrac_lower": torch.zeros((), dtype=log_probs.dtype, device=log_probs.device),
             "ppo_kl": algos.masked_mean(old_log_probs - log_probs, mask)}
    return loss, {name: value.detach() for name, value in stats.items()}


def group_rank_advantage(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0,
                         lam=1.0, norm_by_std=True):
    """The registry's advantage estimator call form; returns (advantages, returns), both [B, T]."""
    CALLS["group_rank"] += 1
    if group_ids is None:
        raise ValueError("advantage estimator 'group_rank' needs group_ids")
    scores = token_rewards.sum(-1)  # [B]
    centred = torch.zeros_like(scores)
    for group in group_ids.unique():
        rows = (group_ids == group).nonzero().squeeze(-1)
        if len(rows) < 2:
            continue
        group_scores = scores[rows]
        below = (group_scores.unsqueeze(0) < group_scores.unsqueeze(1)).sum(-1).float()  # rank, from 0
        ties = (group_scores.unsqueeze(0) == group_scores.unsqueeze(1)).sum(-1).float()
        mean_rank = below + (ties - 1) / 2
        half = (len(rows) - 1) / 2
        centred[rows] = (mean_rank - half) / half
    advantages = centred.unsqueeze(-1) * mask
    return advantages, advantages


algos.register_policy_loss("cispo", cispo_loss)
algos.register_advantage_estimator("group_rank", group_rank_advantage)
