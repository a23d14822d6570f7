"""Masked statistics, advantage estimators and the registry: hand-worked examples and reference loops."""

import math
import random
import statistics

import pytest
import torch

from rlfabric import algorithms as algos


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), t(expected), atol=tol, rtol=tol)


# ---- masked statistics ----

X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
M = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # valid: 1, 2, 4


def test_masked_mean_by_hand():
    close(algos.masked_mean(t(X), t(M)), 7 / 3)
    close(algos.masked_mean(t(X), t(M), dim=-1), [1.5, 4.0])
    close(algos.masked_mean(t(X), torch.tensor(M).bool()), 7 / 3)  # bool masks work too
    close(algos.masked_mean(t(X), torch.zeros(2, 3)), 0.0)  # empty mask: 0 / 1e-8 = 0, as in VeRL


def test_masked_var_by_hand():
    mean = 7 / 3
    sq_dev = (1 - mean) ** 2 + (2 - mean) ** 2 + (4 - mean) ** 2  # 42/9
    close(algos.masked_var(t(X), t(M)), sq_dev / 2)  # unbiased: / (N - 1)
    close(algos.masked_var(t(X), t(M), unbiased=False), sq_dev / 3)


def test_masked_whiten_by_hand():
    mean, var = 7 / 3, 7 / 3  # from the two tests above (42/18 = 7/3)
    expected = [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in X]
    close(algos.masked_whiten(t(X), t(M)), expected)
    unshifted = [[e + mean for e in row] for row in expected]
    close(algos.masked_whiten(t(X), t(M), shift_mean=False), unshifted)


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_var_needs_two_elements(n_valid):
    mask = torch.zeros(2, 3)
    mask[0, :n_valid] = 1
    with pytest.raises(ValueError, match=f"masked_var: mask has {n_valid} valid elements"):
        algos.masked_var(t(X), mask)


def test_masked_whiten_on_empty_mask_raises():
    with pytest.raises(ValueError, match="masked_whiten: mask has 0 valid elements"):
        algos.masked_whiten(t(X), torch.zeros(2, 3))


def test_masked_mean_shape_mismatch():
    with pytest.raises(ValueError, match=r"masked_mean: mask shape \(2, 2\) does not match x shape \(2, 3\)"):
        algos.masked_mean(t(X), torch.ones(2, 2))


# ---- GAE ----


def test_gae_by_hand():
    gamma, lam = 0.9, 0.8
    rewards = t([[0.0, 1.0, 5.0]])  # the 5 sits on padding and must be ignored
    values = t([[0.5, 0.2, 9.0]])
    mask = t([[1.0, 1.0, 0.0]])
    # t=2 (pad): nothing carried, lastgaelam stays 0 -> adv 0
    # t=1: delta = 1 + 0.9*0 - 0.2 = 0.8; adv = 0.8
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32; adv = -0.32 + 0.9*0.8*0.8 = 0.256
    raw = [0.256, 0.8, 0.0]
    advantages, returns = algos.compute_gae(rewards, values, mask, gamma, lam)
    close(returns, [[0.256 + 0.5, 0.8 + 0.2, 0.0 + 9.0]])
    mean = (0.256 + 0.8) / 2
    var = ((0.256 - mean) ** 2 + (0.8 - mean) ** 2) / 1
    close(advantages, [[(a - mean) / math.sqrt(var + 1e-8) for a in raw]])


def reference_gae(r, v, m, gamma, lam):
    """Straight from the reference text, one row at a time, plain Python floats."""
    out = []
    for r_row, v_row, m_row in zip(r, v, m, strict=True):
        next_values, last, adv = 0.0, 0.0, [0.0] * len(r_row)
        for i in reversed(range(len(r_row))):
            delta = r_row[i] + gamma * next_values - v_row[i]
            g = delta + gamma * lam * last
            next_values = v_row[i] * m_row[i] + (1 - m_row[i]) * next_values
            last = g * m_row[i] + (1 - m_row[i]) * last
            adv[i] = last
        out.append(adv)
    return out


def test_gae_matches_reference_loop():
    gen = torch.Generator().manual_seed(0)
    r, v = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    m = (torch.rand(5, 7, generator=gen) > 0.3).float()
    raw = reference_gae(r.tolist(), v.tolist(), m.tolist(), 0.95, 0.9)
    advantages, returns = algos.compute_gae(r, v, m, 0.95, 0.9)
    close(returns, (t(raw) + v).tolist())
    close(advantages, algos.masked_whiten(t(raw), m).tolist())


# ---- GRPO / RLOO ----

GROUP_IDS = torch.tensor([7, 7, 7, 3, 3, 5])
SCORES = [1.0, 0.0, 0.0, 2.0, 4.0, 5.0]
LENGTHS = [2, 1, 2, 2, 1, 2]


def outcome_batch():
    """Score on the last valid token of a [6, 3] batch."""
    rewards, mask = torch.zeros(6, 3), torch.zeros(6, 3)
    for i, (s, n) in enumerate(zip(SCORES, LENGTHS, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def test_grpo_by_hand():
    rewards, mask = outcome_batch()
    eps = 1e-6
    std7 = math.sqrt(((1 - 1 / 3) ** 2 + 2 * (0 - 1 / 3) ** 2) / 2)  # sqrt(1/3)
    std3 = math.sqrt(((2 - 3) ** 2 + (4 - 3) ** 2) / 1)  # sqrt(2)
    per_row = [(1 - 1 / 3) / (std7 + eps), (0 - 1 / 3) / (std7 + eps), (0 - 1 / 3) / (std7 + eps),
               (2 - 3) / (std3 + eps), (4 - 3) / (std3 + eps), (5 - 0) / (1 + eps)]  # singleton: mu 0, sigma 1
    advantages, returns = algos.compute_grpo_advantage(rewards, mask, GROUP_IDS)
    expected = [[a * m for m in row] for a, row in zip(per_row, mask.tolist(), strict=True)]
    close(advantages, expected)
    close(returns, expected)


def test_dr_grpo_by_hand():
    rewards, mask = outcome_batch()
    per_row = [1 - 1 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 5.0]
    advantages, _ = algos.compute_grpo_advantage(rewards, mask, GROUP_IDS, norm_by_std=False)
    close(advantages, [[a * m for m in row] for a, row in zip(per_row, mask.tolist(), strict=True)])


def test_rloo_by_hand():
    rewards, mask = outcome_batch()
    # score minus the mean of the other members; a singleton keeps its score
    per_row = [1 - (0 + 0) / 2, 0 - (1 + 0) / 2, 0 - (1 + 0) / 2, 2 - 4, 4 - 2, 5.0]
    advantages, returns = algos.compute_rloo_advantage(rewards, mask, GROUP_IDS)
    expected = [[a * m for m in row] for a, row in zip(per_row, mask.tolist(), strict=True)]
    close(advantages, expected)
    close(returns, expected)


def test_grpo_matches_reference_loop():
    rng = random.Random(1)
    ids = [rng.randrange(5) for _ in range(40)]
    scores = [rng.random() * 3 for _ in ids]
    groups = {}
    for i, s in zip(ids, scores, strict=True):
        groups.setdefault(i, []).append(s)
    expected = []
    for i, s in zip(ids, scores, strict=True):
        g = groups[i]
        mu, sigma = (0.0, 1.0) if len(g) == 1 else (statistics.mean(g), statistics.stdev(g))
        expected.append((s - mu) / (sigma + 1e-6))
    rewards = torch.zeros(40, 2)
    rewards[:, 1] = t(scores)
    advantages, _ = algos.compute_grpo_advantage(rewards, torch.ones(40, 2), torch.tensor(ids))
    close(advantages[:, 0], expected)


# ---- REINFORCE++ / ReMax ----


def test_reinforce_pp_by_hand():
    gamma = 0.5
    rewards = t([[1.0, 2.0, 7.0, 4.0], [0.0, 0.0, 1.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # row 0: t3: G=4; t2 (pad): G=0, running stays 4; t1: 2 + 0.5*4 = 4; t0: 1 + 0.5*4 = 3
    # row 1: t3 (pad): G=0; t2: 1; t1: 0.5; t0: 0.25
    expected_returns = [[3.0, 4.0, 0.0, 4.0], [0.25, 0.5, 1.0, 0.0]]
    valid = [3.0, 4.0, 4.0, 0.25, 0.5, 1.0]
    mean, var = statistics.mean(valid), statistics.variance(valid)  # variance() is unbiased
    expected_adv = [[(g - mean) / math.sqrt(var + 1e-8) * m for g, m in zip(g_row, m_row, strict=True)]
                    for g_row, m_row in zip(expected_returns, mask.tolist(), strict=True)]
    advantages, returns = algos.compute_reinforce_pp_advantage(rewards, mask, gamma)
    close(returns, expected_returns)
    close(advantages, expected_adv)


def test_remax_by_hand():
    rewards = t([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 3.0]])  # row 1's 3.0 is on padding
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    baselines = t([0.4, 1.0])
    advantages, returns = algos.compute_remax_advantage(rewards, baselines, mask)
    close(returns, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    close(advantages, [[0.6, 0.6, 0.6, 0.0], [1.0, 1.0, 0.0, 0.0]])


# ---- bad input ----


def test_estimator_bad_input():
    r, m = torch.zeros(3, 4), torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"compute_gae: values shape \(3, 5\) does not match token_rewards"):
        algos.compute_gae(r, torch.zeros(3, 5), m)
    with pytest.raises(ValueError, match=r"compute_grpo_advantage: mask shape \(3, 3\) does not match"):
        algos.compute_grpo_advantage(r, torch.ones(3, 3), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="compute_grpo_advantage: group_ids must be an integer tensor"):
        algos.compute_grpo_advantage(r, m, torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"compute_rloo_advantage: group_ids must have shape \(3,\)"):
        algos.compute_rloo_advantage(r, m, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"compute_remax_advantage: baselines must have shape \(3,\)"):
        algos.compute_remax_advantage(r, torch.zeros(3, 1), m)
    with pytest.raises(ValueError, match="compute_reinforce_pp_advantage: token_rewards must be 2-D"):
        algos.compute_reinforce_pp_advantage(torch.zeros(4), torch.ones(4))


# ---- registry ----


def test_registry_builtins_match_direct_calls():
    rewards, mask = outcome_batch()
    values = torch.linspace(0, 1, 18).reshape(6, 3)
    kwargs = dict(token_rewards=rewards, mask=mask, values=values, group_ids=GROUP_IDS,
                  baselines=torch.ones(6), gamma=0.9, lam=0.8, norm_by_std=False)
    assert set(algos.advantage_estimator_names()) >= {"gae", "grpo", "rloo", "reinforce_plus_plus", "remax"}
    pairs = {
        "gae": algos.compute_gae(rewards, values, mask, 0.9, 0.8),
        "grpo": algos.compute_grpo_advantage(rewards, mask, GROUP_IDS, norm_by_std=False),
        "rloo": algos.compute_rloo_advantage(rewards, mask, GROUP_IDS),
        "reinforce_plus_plus": algos.compute_reinforce_pp_advantage(rewards, mask, 0.9),
        "remax": algos.compute_remax_advantage(rewards, torch.ones(6), mask),
    }
    for name, (adv, ret) in pairs.items():
        got_adv, got_ret = algos.get_advantage_estimator(name)(**kwargs)
        torch.testing.assert_close(got_adv, adv)
        torch.testing.assert_close(got_ret, ret)


def test_registry_unknown_and_missing_arguments():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'; known: gae, gdpo, gpg, grpo, grpo_passk"):
        algos.get_advantage_estimator("ppo2")
    with pytest.raises(ValueError, match="unknown policy loss mode 'clip'; known: bypass_mode, cispo, clip_cov, dppo_kl"):
        algos.get_policy_loss("clip")
    with pytest.raises(ValueError, match="advantage estimator 'gae' needs values"):
        algos.get_advantage_estimator("gae")(token_rewards=torch.zeros(2, 2), mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="'grpo' is built in and cannot be replaced"):
        algos.register_advantage_estimator("grpo", lambda **kw: None)
    with pytest.raises(ValueError, match="'vanilla' is built in and cannot be replaced"):
        algos.register_policy_loss("vanilla", lambda *a, **kw: None, overwrite=True)


def test_register_custom_estimator_with_one_call():
    def sign_of_score(*, token_rewards, mask, values=None, group_ids=None, baselines=None,
                      gamma=1.0, lam=1.0, norm_by_std=True):
        adv = torch.sign(token_rewards.sum(-1, keepdim=True)) * mask
        return adv, adv

    algos.register_advantage_estimator("test_sign_of_score", sign_of_score)
    assert "test_sign_of_score" in algos.advantage_estimator_names()
    adv, _ = algos.get_advantage_estimator("test_sign_of_score")(
        token_rewards=t([[0.0, -2.0], [3.0, 0.0]]), mask=t([[1.0, 1.0], [1.0, 0.0]]))
    close(adv, [[-1.0, -1.0], [1.0, 0.0]])
    algos.register_advantage_estimator("test_sign_of_score", sign_of_score, overwrite=True)  # allowed


def test_register_custom_policy_loss_mode():
    def mean_ratio_loss(old_log_probs, log_probs, advantages, mask, **kwargs):
        loss = algos.aggregate_loss(-advantages * torch.exp(log_probs - old_log_probs), mask, "token-mean")
        return loss, {"pg_clipfrac": torch.tensor(0.0)}

    algos.register_policy_loss("test_unclipped", mean_ratio_loss)
    zeros = torch.zeros(1, 2)
    loss, _ = algos.policy_loss(zeros, zeros, t([[1.0, 3.0]]), torch.ones(1, 2), mode="test_unclipped")
    close(loss, -2.0)  # ratio 1 everywhere: -(1 + 3) / 2
