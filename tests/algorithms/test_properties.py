"""Property tests (hypothesis) for the algorithm core."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlfabric import algorithms as algos

FAST = settings(max_examples=50, deadline=None)


@st.composite
def batches(draw, min_batch=1, max_batch=6, max_len=6):
    """A seeded generator and a right-padded 0/1 mask [batch, response_len] (rows may be empty)."""
    batch = draw(st.integers(min_batch, max_batch))
    length = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float()  # [batch, len]
    seed = draw(st.integers(0, 2**16))
    return torch.Generator().manual_seed(seed), mask


@FAST
@given(st.lists(st.integers(0, 4), min_size=2, max_size=24), st.data())
def test_grpo_advantages_sum_to_zero_within_group(ids, data):
    # scores on a grid of halves, as rule-based rewards are, so group sums are exact
    scores = data.draw(st.lists(st.integers(-4, 4), min_size=len(ids), max_size=len(ids)))
    rewards = torch.zeros(len(ids), 3)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float32) / 2
    group_ids = torch.tensor(ids)
    for norm_by_std in (True, False):
        adv, _ = algos.compute_grpo_advantage(rewards, torch.ones(len(ids), 3), group_ids, norm_by_std)
        for g in set(ids):
            rows = group_ids == g
            if rows.sum() > 1:
                assert abs(adv[rows, 0].sum().item()) < 1e-4 * rows.sum().item()


@FAST
@given(batches(min_batch=2))
def test_gae_with_unit_gamma_lambda_and_zero_values_is_reward_to_go(case):
    gen, mask = case
    assume(mask.sum() >= 2)
    rewards = torch.randn(mask.shape, generator=gen)
    _, returns = algos.compute_gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    # reward-to-go over valid tokens: sum_{k >= t, m_k = 1} r_k (padding carries it through)
    expected = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for j in reversed(range(rewards.shape[1])):
            running += rewards[i, j].item() * mask[i, j].item()
            expected[i, j] = running
    torch.testing.assert_close(returns, expected, atol=1e-5, rtol=1e-5)


def _perturb_masked(x, mask, gen):
    return torch.where(mask.bool(), x, x + 10 * torch.randn(x.shape, generator=gen))


@FAST
@given(batches(), st.sampled_from(algos.AGG_MODES), st.sampled_from(["vanilla", "gspo"]))
def test_masked_tokens_do_not_change_policy_loss(case, agg, mode):
    gen, mask = case
    old, new, adv = (torch.randn(mask.shape, generator=gen) for _ in range(3))
    loss, stats = algos.policy_loss(old, new, adv, mask, agg=agg, mode=mode)
    loss2, stats2 = algos.policy_loss(*(_perturb_masked(x, mask, gen) for x in (old, new, adv)), mask,
                                      agg=agg, mode=mode)
    torch.testing.assert_close(loss2, loss)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        torch.testing.assert_close(stats2[key], stats[key])


@FAST
@given(batches(), st.sampled_from(algos.AGG_MODES))
def test_masked_tokens_do_not_change_value_or_aggregated_loss(case, agg):
    gen, mask = case
    values, returns, old = (torch.randn(mask.shape, generator=gen) for _ in range(3))
    loss, stats = algos.value_loss(values, returns, old, mask, agg=agg)
    loss2, stats2 = algos.value_loss(*(_perturb_masked(x, mask, gen) for x in (values, returns, old)), mask,
                                     agg=agg)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(stats2["vf_clipfrac"], stats["vf_clipfrac"])
    kl = algos.kl_penalty(values, old, "k3")
    torch.testing.assert_close(algos.aggregate_loss(_perturb_masked(kl, mask, gen), mask, agg),
                               algos.aggregate_loss(kl, mask, agg))


@FAST
@given(st.integers(0, 2**16), st.sampled_from(["k1", "kl", "abs", "k3", "low_var_kl", "k2", "mse"]))
def test_straight_through_kl_has_k2_gradient(seed, kind):
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randn(3, 5, generator=gen).requires_grad_()
    ref = torch.randn(3, 5, generator=gen)
    kl = algos.kl_penalty(logp, ref, kind + "+")
    torch.testing.assert_close(kl, algos.kl_penalty(logp, ref, kind))  # forward: the named estimator
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())  # d/dlogp of (logp - ref)^2 / 2


@FAST
@given(batches(min_batch=2), st.sampled_from(algos.AGG_MODES), st.data())
def test_global_counts_over_two_ranks_sum_to_single_process(case, agg, data):
    gen, mask = case
    loss_mat = torch.randn(mask.shape, generator=gen)
    split = data.draw(st.integers(1, mask.shape[0] - 1))
    global_tokens = mask.sum()
    global_seqs = max((mask.sum(-1) > 0).sum().item(), 1)  # as the ranks would all-reduce them
    per_rank = [
        algos.aggregate_loss(loss_mat[rows], mask[rows], agg,
                             global_token_count=global_tokens, global_seq_count=global_seqs)
        for rows in (slice(0, split), slice(split, None))
    ]
    torch.testing.assert_close(per_rank[0] + per_rank[1], algos.aggregate_loss(loss_mat, mask, agg),
                               atol=1e-5, rtol=1e-5)


@FAST
@given(
    st.floats(1e-4, 1.0),  # init beta
    st.floats(1e-3, 1.0),  # target
    st.floats(0.0, 5.0),  # measured KL
    st.integers(1, 1000),  # n_steps
)
def test_adaptive_controller_moves_toward_target(init, target, current_kl, n_steps):
    assume(abs(current_kl / target - 1) > 1e-3)
    ctrl = algos.AdaptiveKLController(init, target=target, horizon=1000)
    ctrl.update(current_kl, n_steps)
    if current_kl > target:
        assert ctrl.value > init
    else:
        assert ctrl.value < init
    assert ctrl.value >= init * 0.8 and ctrl.value <= init * 1.2  # at most 20% per horizon


@pytest.mark.parametrize("n_valid", [2, 5])
def test_whitened_advantages_have_zero_mean_unit_var(n_valid):
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(n_valid)) * 3 + 2
    mask = torch.zeros(1, 6)
    mask[0, :n_valid] = 1
    w = algos.masked_whiten(x, mask)
    assert abs(algos.masked_mean(w, mask).item()) < 1e-5
    assert abs(algos.masked_var(w, mask).item() - 1) < 1e-4
