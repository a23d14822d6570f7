"""An algorithm plugin (algorithm.plugin_modules): a policy loss and an advantage estimator registered
without editing rlfabric. Put this folder on the services' import path and name the module in the
mesh's config:

    PYTHONPATH=examples/plugins rlfabric train algorithm.plugin_modules=[topr_plugin] \\
        actor.loss_mode=topr algorithm.adv_estimator=group_rank

- "topr" (Tapered Off-Policy REINFORCE, Le Roux et al. 2025, arXiv 2503.14286): REINFORCE on each token's
  log-prob; a token with a positive advantage learns as in supervised fine-tuning (no importance weight),
  one with a negative advantage is weighted by its importance ratio truncated to [0, 1] and detached, so
  pushing a bad token down stops once the policy has left it. Reports actor/topr_truncfrac (the tokens
  with A < 0 whose ratio was above 1). The clip settings are unused.
- "group_rank": each sample's advantage is its score's rank within its prompt's group, centred and
  scaled to [-1, 1] (ties share their mean rank); a group of one gets 0.

CALLS counts the calls of each in this process (the tests read it).
"""

from __future__ import annotations

import torch

from rlfabric import algorithms as algos

CALLS = {"topr": 0, "group_rank": 0}


def topr_loss(old_log_probs, log_probs, advantages, mask, *, clip_low, clip_high, clip_ratio_c, agg,
              global_token_count, global_seq_count, scale_factor, rollout_is_weights):
    """The registry's policy loss call form (rlfabric.algorithms.registry)."""
    CALLS["topr"] += 1
    ratio = torch.exp(torch.clamp(log_probs - old_log_probs, -20.0, 20.0)).detach()  # [B, T]
    weight = torch.where(advantages >= 0, torch.ones_like(ratio), torch.clamp(ratio, max=1.0))
    pg_losses = -advantages * weight * log_probs  # [B, T]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = algos.aggregate_loss(pg_losses, mask, agg or "token-mean", global_token_count=global_token_count,
                                global_seq_count=global_seq_count, scale_factor=scale_factor)
    truncated = algos.masked_mean(((advantages < 0) & (ratio > 1.0)).to(log_probs.dtype), mask)
    stats = {"topr_truncfrac": truncated, "ppo_kl": algos.masked_mean(old_log_probs - log_probs, mask)}
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


algos.register_policy_loss("topr", topr_loss)
algos.register_advantage_estimator("group_rank", group_rank_advantage)
