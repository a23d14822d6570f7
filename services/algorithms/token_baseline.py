"""Optimal Token Baseline (OTB): a baseline for each token position of a prompt's group, weighted by how
much gradient variance each response has built up so far (VeRL's optimal_token_baseline and
tir_optimal_token_baseline).

With G_t the reward-to-go of a response at token t, pi_t the trainer's probability of the sampled token and
sum_pi_squared_t = sum_v pi(v)^2 over the vocabulary at t, the squared norm of the log-prob's gradient with
respect to the logits is ||s_t||^2 = 1 - 2 pi_t + sum_pi_squared_t. Its running sum W_t = sum_{j <= t} ||s_j||^2
(times the rollout IS weight squared, rho_t^2, when rollout correction weights the loss) is the path-variance
proxy, and the baseline minimising the variance of the group's policy gradient at t is

    B_t = sum_i G_t^i W_t^i / (sum_i W_t^i + 1e-8)       over the responses i of the group,

so A_t = G_t - B_t. A group of one has B = 0. With handle_zero_tail, when one response is longer than all
the others of its group, its positions past the second-longest have B = 0 (the baseline there would be its
own return, and its advantage 0).

optimal_token_baseline lines the responses up by position t; tir_optimal_token_baseline (multi-turn, tool
output inside the response) by the k-th trained token of each response, so that the environment's tokens
(mask 0) do not shift one response against the others. Per-token tensors are [batch, response_len].
"""

import torch

from ._checks import check_2d, check_group_ids, check_same_shape
from .registry import register_advantage_estimator
from .stats import EPS, group_index, group_reduce, group_sum


def path_variance(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor,
                  rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """W_t [batch, response_len]: the running sum over the trained tokens of 1 - 2 pi_t + sum_pi_squared_t
    (times rho_t^2 with rollout IS weights)."""
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared  # [B, T] ||s_t||^2
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights**2
    return (per_token * mask).cumsum(dim=-1)


def _check(fn: str, token_rewards, mask, group_ids, old_log_probs, sum_pi_squared, rollout_is_weights) -> None:
    check_2d(fn, "token_rewards", token_rewards)
    for name, value in (("mask", mask), ("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared),
                        ("rollout_is_weights", rollout_is_weights)):
        if value is not None:
            check_same_shape(fn, name, value, "token_rewards", token_rewards)
    check_group_ids(fn, group_ids, token_rewards.shape[0])


def _group_baseline(returns: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor,
                    handle_zero_tail: bool, epsilon: float) -> torch.Tensor:
    """[B, L] each row's group's sum_i G W / (sum_i W + epsilon) per column (0 for a group of one, and past
    the second-longest response for a group's single longest one with handle_zero_tail); returns and weights
    [B, L] are 0 where a row has no token, lengths [B] count each row's tokens."""
    inverse, counts = group_index(group_ids)  # [B], [groups]
    n_groups = counts.numel()
    numerator = torch.zeros(n_groups, returns.shape[1], dtype=returns.dtype, device=returns.device)
    denominator = torch.zeros_like(numerator)
    numerator.index_add_(0, inverse, returns * weights)  # [groups, L]
    denominator.index_add_(0, inverse, weights)
    baseline = (numerator / (denominator + epsilon))[inverse]  # [B, L]
    baseline = baseline * (counts[inverse] > 1).unsqueeze(-1)
    if handle_zero_tail:
        lengths = lengths.to(returns.dtype)
        longest = group_reduce(lengths, inverse, n_groups, "amax")[inverse]  # [B]
        is_longest = lengths == longest
        alone = group_sum(is_longest.to(returns.dtype), inverse, n_groups)[inverse] == 1
        second = group_reduce(torch.where(is_longest, -1.0, lengths), inverse, n_groups, "amax")[inverse]
        tail_rows = is_longest & alone & (counts[inverse] > 1)  # [B] its group's only longest response
        positions = torch.arange(returns.shape[1], device=returns.device)
        tail = tail_rows.unsqueeze(-1) & (positions.unsqueeze(0) >= second.unsqueeze(-1))  # [B, L]
        baseline = baseline.masked_fill(tail, 0.0)
    return baseline


def compute_optimal_token_baseline_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True,
    epsilon: float = EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB by token position: A_t = G_t - B_t (module docstring), returns G_t."""
    _check("compute_optimal_token_baseline_advantage", token_rewards, mask, group_ids, old_log_probs,
           sum_pi_squared, rollout_is_weights)
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, T] G_t
        weights = path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights) * mask  # [B, T]
        baseline = _group_baseline(returns * mask, weights, mask.sum(-1), group_ids, handle_zero_tail, epsilon)
        return (returns - baseline) * mask, returns


def compute_tir_optimal_token_baseline_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True,
    epsilon: float = EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB by the k-th trained token of each response (multi-turn: the environment's tokens in between do not
    count); responses without a trained token are in no group. Returns (advantages, G_t)."""
    _check("compute_tir_optimal_token_baseline_advantage", token_rewards, mask, group_ids, old_log_probs,
           sum_pi_squared, rollout_is_weights)
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, T] G_t
        weights = path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights)  # [B, T]
        trained = mask.bool()
        lengths = trained.sum(-1)  # [B]
        rows, positions = trained.nonzero(as_tuple=True)
        ordinal = (trained.cumsum(-1) - 1)[rows, positions]  # each trained token's k within its response
        width = int(lengths.max()) if lengths.numel() else 0

        def compact(x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, width], the k-th trained token at k
            out = x.new_zeros(x.shape[0], width)
            out[rows, ordinal] = x[rows, positions]
            return out

        # A response with no trained token gets an id of its own, so it joins no group.
        empty = lengths == 0
        group_ids = group_ids.clone()
        group_ids[empty] = group_ids.max() + 1 + torch.arange(int(empty.sum()), device=group_ids.device)
        compact_returns = compact(returns)
        baseline = _group_baseline(compact_returns, compact(weights), lengths, group_ids, handle_zero_tail, epsilon)
        advantages = torch.zeros_like(returns)
        advantages[rows, positions] = (compact_returns - baseline)[rows, ordinal]
        return advantages, returns


def _check_inputs(name: str, inputs: dict[str, torch.Tensor | None]) -> None:
    missing = [key for key in ("group_ids", "old_log_probs", "sum_pi_squared") if inputs[key] is None]
    if missing:
        raise ValueError(f"{name} needs {', '.join(missing)} (the actor's log-prob pass gives old_log_probs and "
                         "sum_pi_squared)")


def _otb(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
         norm_by_std=True, old_log_probs=None, sum_pi_squared=None, rollout_is_weights=None):
    _check_inputs("optimal_token_baseline", locals())
    return compute_optimal_token_baseline_advantage(token_rewards, mask, group_ids, old_log_probs, sum_pi_squared,
                                                    rollout_is_weights)


def _tir_otb(*, token_rewards, mask, values=None, group_ids=None, baselines=None, gamma=1.0, lam=1.0,
             norm_by_std=True, old_log_probs=None, sum_pi_squared=None, rollout_is_weights=None):
    _check_inputs("tir_optimal_token_baseline", locals())
    return compute_tir_optimal_token_baseline_advantage(token_rewards, mask, group_ids, old_log_probs,
                                                        sum_pi_squared, rollout_is_weights)


OTB_INPUTS = ("old_log_probs", "sum_pi_squared", "rollout_is_weights")
register_advantage_estimator("optimal_token_baseline", _otb, inputs=OTB_INPUTS)
register_advantage_estimator("tir_optimal_token_baseline", _tir_otb, inputs=OTB_INPUTS)
