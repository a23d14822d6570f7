"""Every advantage estimator and policy loss honours a multi-turn loss mask: on the model's tokens they give
exactly what they give for the same trajectories with the environment's tokens cut out, and the environment's
tokens themselves get no loss. GRPO and RLOO group whole trajectories (one row each)."""

import pytest
import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.rollout_batch import token_level_scores

# 4 trajectories, 2 groups; 0 = a token the environment gave (an observation between two model turns), or padding.
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0],
                     [1, 0, 0, 1, 1, 1, 1, 0],
                     [1, 1, 1, 1, 0, 0, 0, 0],
                     [1, 0, 1, 0, 1, 0, 1, 0]])
SCORES = torch.tensor([1.0, 0.0, 0.5, 2.0])
GROUPS = torch.tensor([0, 0, 1, 1])


def compress(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked-in entries moved left, the rest 0: the trajectories without the environment's tokens."""
    out = torch.zeros_like(tensor)
    for i in range(len(tensor)):
        kept = tensor[i][mask[i].bool()]
        out[i, : len(kept)] = kept
    return out


def compressed_mask() -> torch.Tensor:
    return compress(MASK, MASK)


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"])
def test_estimators_see_only_the_model_tokens(name):
    torch.manual_seed(0)
    values = torch.randn(MASK.shape)
    estimator = algos.get_advantage_estimator(name)
    common = dict(group_ids=GROUPS, baselines=torch.tensor([0.5, 0.5, 1.0, 1.0]), gamma=0.9, lam=0.8, norm_by_std=True)
    full_adv, full_ret = estimator(token_rewards=token_level_scores(SCORES, MASK), mask=MASK,
                                   values=values, **common)
    cut_adv, cut_ret = estimator(token_rewards=token_level_scores(SCORES, compressed_mask()), mask=compressed_mask(),
                                 values=compress(values, MASK), **common)
    torch.testing.assert_close(compress(full_adv, MASK), cut_adv * compressed_mask())
    torch.testing.assert_close(compress(full_ret, MASK), cut_ret * compressed_mask())


@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_losses_see_only_the_model_tokens(mode, agg):
    torch.manual_seed(1)
    old, new, advantages = torch.randn(MASK.shape), torch.randn(MASK.shape), torch.randn(MASK.shape)
    env_noise = torch.where(MASK.bool(), 0.0, 1e3)  # anything on the environment's tokens must not count
    full, _ = algos.policy_loss(old + env_noise, new - env_noise, advantages + env_noise, MASK, agg=agg, mode=mode)
    cut, _ = algos.policy_loss(compress(old, MASK), compress(new, MASK), compress(advantages, MASK), compressed_mask(),
                               agg=agg, mode=mode)
    torch.testing.assert_close(full, cut)


def test_grpo_groups_whole_trajectories():
    advantages, _ = algos.get_advantage_estimator("grpo")(
        token_rewards=token_level_scores(SCORES, MASK), mask=MASK, group_ids=GROUPS, values=None, baselines=None,
        gamma=1.0, lam=1.0, norm_by_std=False)
    # one advantage per trajectory (score minus its group's mean) on every model token, 0 on the environment's
    expected = torch.tensor([0.5, -0.5, -0.75, 0.75]).unsqueeze(-1) * MASK
    torch.testing.assert_close(advantages, expected)
