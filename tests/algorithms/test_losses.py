"""Loss aggregation, policy/value losses, KL, logits helpers and DAPO pieces: hand-worked examples."""

import math

import pytest
import torch

from rlfabric import algorithms as algos


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), t(expected), atol=tol, rtol=tol)


# ---- aggregation ----

L = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
LM = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # third sequence is empty: not counted


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 4) / 3),
    ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + 4) / 2 / 3),  # default scale: padded length 3
])
def test_aggregate_by_hand(mode, expected):
    close(algos.aggregate_loss(t(L), t(LM), mode), expected)


def test_aggregate_counts_and_scale_factor():
    close(algos.aggregate_loss(t(L), t(LM), "token-mean", global_token_count=10), 7 / 10)
    close(algos.aggregate_loss(t(L), t(LM), "seq-mean-token-sum", global_seq_count=4), 7 / 4)
    close(algos.aggregate_loss(t(L), t(LM), "seq-mean-token-sum-norm", scale_factor=7.0), 3.5 / 7)


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_aggregate_all_empty_mask_is_zero(mode):
    close(algos.aggregate_loss(t(L), torch.zeros(3, 3), mode), 0.0)


def test_aggregate_bad_input():
    with pytest.raises(ValueError, match="aggregate_loss: unknown mode 'tokenmean'; known: seq-mean-token-mean"):
        algos.aggregate_loss(t(L), t(LM), "tokenmean")
    with pytest.raises(ValueError, match=r"aggregate_loss: mask shape \(3, 2\) does not match loss_mat"):
        algos.aggregate_loss(t(L), torch.ones(3, 2), "token-mean")
    with pytest.raises(ValueError, match="aggregate_loss: global_seq_count must be > 0"):
        algos.aggregate_loss(t(L), t(LM), "seq-mean-token-mean", global_seq_count=0)


# ---- policy loss ----


def test_vanilla_policy_loss_by_hand():
    # log-ratio per token: 0.5, -0.5, 1.5, -1.0, and a padded one (100.0, ignored)
    log_ratio = [0.5, -0.5, 1.5, -1.0, 100.0]
    adv = [1.0, 1.0, -1.0, -1.0, 5.0]
    mask = [1.0, 1.0, 1.0, 1.0, 0.0]
    old = t([[-1.0] * 5])
    new = old + t([log_ratio])
    # token 0: ratio e^0.5 = 1.65 > 1.2, A > 0 -> clipped: -1.2
    # token 1: ratio e^-0.5 = 0.61, A > 0 -> unclipped (max(-0.61, -0.8)): -e^-0.5
    # token 2: ratio e^1.5 = 4.48, A < 0 -> max(4.48, 1.2) = 4.48, dual clip caps at -A*3 = 3
    # token 3: ratio e^-1 = 0.37, A < 0 -> max(0.37, 0.8) = 0.8 (clipped)
    per_token = [-1.2, -math.exp(-0.5), 3.0, 0.8]
    loss, stats = algos.policy_loss(old, new, t([adv]), t([mask]))
    close(loss, sum(per_token) / 4)
    close(stats["pg_clipfrac"], 2 / 4)  # tokens 0 and 3
    close(stats["pg_clipfrac_lower"], 1 / 4)  # token 2
    close(stats["ppo_kl"], -(0.5 - 0.5 + 1.5 - 1.0) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_vanilla_clip_high_is_decoupled():
    old, new = t([[0.0]]), t([[math.log(1.25)]])
    loss, _ = algos.policy_loss(old, new, t([[1.0]]), t([[1.0]]), clip_high=0.28)
    close(loss, -1.25)  # inside [0.8, 1.28]: unclipped
    loss, _ = algos.policy_loss(old, new, t([[1.0]]), t([[1.0]]))
    close(loss, -1.2)


def test_vanilla_gradient_is_zero_where_clipped():
    old = t([[0.0, 0.0]])
    new = t([[0.5, 0.1]]).requires_grad_()
    loss, _ = algos.policy_loss(old, new, t([[1.0, 1.0]]), t([[1.0, 1.0]]))
    loss.backward()
    # token 0 clipped (no gradient); token 1: d(-e^x)/dx / 2 tokens
    close(new.grad, [[0.0, -math.exp(0.1) / 2]])


def test_gspo_by_hand():
    old = t([[0.0, 0.0], [0.0, 0.0]])
    new = t([[0.1, 0.3], [-0.1, 0.5]]).requires_grad_()  # row 1, token 1 is padding
    adv, mask = t([[1.0, 1.0], [1.0, 1.0]]), t([[1.0, 1.0], [1.0, 0.0]])
    s0, s1 = math.exp((0.1 + 0.3) / 2), math.exp(-0.1 / 1)  # sequence ratios 1.22, 0.905
    assert s0 > 1.2  # row 0: clipped to -1.2 on both tokens; row 1: unclipped -s1
    loss, stats = algos.policy_loss(old, new, adv, mask, mode="gspo")
    close(loss, (-1.2 + -s1) / 2)  # seq-mean-token-mean
    close(stats["pg_clipfrac"], 2 / 3)
    close(stats["pg_clipfrac_lower"], 0.0)
    close(stats["ppo_kl"], -(0.1 + 0.3 - 0.1) / 3)
    loss.backward()
    # each token's gradient flows through its own log-prob: d(-s)/d logp_t = -s (row 1, 1 token, 2 seqs)
    close(new.grad, [[0.0, 0.0], [-s1 / 2, 0.0]])
    token_mean, _ = algos.policy_loss(old, new.detach(), adv, mask, mode="gspo", agg="token-mean")
    close(token_mean, (-1.2 * 2 - s1) / 3)


def test_policy_loss_bad_input():
    a, b = torch.zeros(2, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"policy_loss: mask shape \(2, 3\) does not match log_probs shape \(2, 4\)"):
        algos.policy_loss(a, a, a, b)
    with pytest.raises(ValueError, match=r"policy_loss: old_log_probs shape \(2, 3\) does not match"):
        algos.policy_loss(b, a, a, a)
    with pytest.raises(ValueError, match="unknown policy loss mode 'ppo'"):
        algos.policy_loss(a, a, a, a, mode="ppo")
    with pytest.raises(ValueError, match="ppo_clip_loss: clip_ratio_c must be > 1"):
        algos.policy_loss(a, a, a, a, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="aggregate_loss: unknown mode 'sum'"):
        algos.policy_loss(a, a, a, a, agg="sum")


# ---- value loss ----


def test_value_loss_by_hand():
    values, old = t([[1.0, 2.0, 0.0]]), t([[0.0, 2.2, 0.1]])
    returns, mask = t([[0.8, 3.0, -5.0]]), t([[1.0, 1.0, 0.0]])
    # token 0: clipped to 0.5; (1-0.8)^2 = 0.04 < (0.5-0.8)^2 = 0.09 -> 0.09, counts as clipped
    # token 1: inside [1.7, 2.7]; (2-3)^2 = 1 both
    loss, stats = algos.value_loss(values, returns, old, mask, clip_range=0.5)
    close(loss, 0.5 * (0.09 + 1.0) / 2)
    close(stats["vf_clipfrac"], 0.5)
    close(stats["vpred_mean"], 1.5)


def test_value_loss_bad_input():
    with pytest.raises(ValueError, match=r"value_loss: old_values shape \(1, 2\) does not match values"):
        algos.value_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3))


# ---- KL ----

LOGP, REF = t([-1.0, -2.0]), t([-1.5, -1.0])  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize("kinds, expected", [
    (("k1", "kl"), [0.5, -1.0]),
    (("abs",), [0.5, 1.0]),
    (("k2", "mse"), [0.5 * 0.25, 0.5 * 1.0]),
    # x = ref - logp = [-0.5, 1.0]; e^x - x - 1
    (("k3", "low_var_kl"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
])
def test_kl_penalty_by_hand(kinds, expected):
    for kind in kinds:
        close(algos.kl_penalty(LOGP, REF, kind), expected)
        close(algos.kl_penalty(LOGP, REF, kind + "+"), expected)  # forward value unchanged


def test_k3_is_clamped():
    # x = 30 clamps to 20; e^20 - 21 clamps to 10
    close(algos.kl_penalty(t([-30.0]), t([0.0]), "k3"), [10.0])


def test_kl_penalty_bad_input():
    with pytest.raises(ValueError, match="kl_penalty: unknown kind 'k4'; known: abs, abs\\+"):
        algos.kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match=r"kl_penalty: ref_log_probs shape \(3,\) does not match"):
        algos.kl_penalty(LOGP, torch.zeros(3), "k1")


def test_controllers_by_hand():
    fixed = algos.FixedKLController(0.5)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.5
    ctrl = algos.AdaptiveKLController(init_coef=0.1, target=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)  # error 0.5 -> clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctrl.update(current_kl=0.11, n_steps=10)  # error 0.1
    assert ctrl.value == pytest.approx(0.1 * 1.02 * (1 + 0.1 * 10 / 100))
    with pytest.raises(ValueError, match="AdaptiveKLController: target and horizon must be > 0"):
        algos.AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_kl_in_reward_by_hand():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    logp = t([[0.1, 0.2, 0.3], [0.4, -0.2, 5.0]])  # k1 = logp; 5.0 is padding
    ctrl = algos.AdaptiveKLController(init_coef=0.5, target=0.1, horizon=10)
    new_rewards, current_kl = algos.kl_in_reward(rewards, logp, ref, mask, ctrl, "k1")
    close(new_rewards, [[-0.05, -0.1, 1.0 - 0.15], [-0.2, 1.0 + 0.1, 0.0]])  # beta 0.5 (before update)
    expected_kl = ((0.1 + 0.2 + 0.3) / 3 + (0.4 - 0.2) / 2) / 2  # 0.15
    assert current_kl == pytest.approx(expected_kl)
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))  # error 0.5 -> 0.2; n_steps = batch 2


# ---- logits ----


def test_entropy_and_log_probs_by_hand():
    logits = t([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # [batch 1, len 2, vocab 2]
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(algos.entropy_from_logits(logits), [[h, math.log(2.0)]])
    close(algos.log_probs_from_logits(logits, torch.tensor([[1, 0]])), [[math.log(0.75), math.log(0.5)]])


def test_logits_chunking_and_bf16():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    full_logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    full_h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    for chunk in (1, 4, 1000):
        torch.testing.assert_close(algos.log_probs_from_logits(logits, labels, chunk), full_logp)
        torch.testing.assert_close(algos.entropy_from_logits(logits, chunk), full_h)
    assert algos.log_probs_from_logits(logits.bfloat16(), labels).dtype == torch.float32
    assert algos.entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_log_probs_gradient_is_one_hot_minus_softmax():
    logits = t([[0.0, math.log(3.0)]]).requires_grad_()
    algos.log_probs_from_logits(logits, torch.tensor([1])).sum().backward()
    close(logits.grad, [[-0.25, 1 - 0.75]])


def test_log_probs_bad_input():
    with pytest.raises(ValueError, match=r"log_probs_from_logits: labels shape \(2, 4\) does not match"):
        algos.log_probs_from_logits(torch.zeros(2, 3, 7), torch.zeros(2, 4, dtype=torch.long))


# ---- DAPO ----


def test_filter_groups_by_hand():
    scores = t([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = algos.filter_groups(scores, ids)
    # group 0 all 1.0 (drop), group 1 mixed (keep), group 2 all 0.5 (drop), group 3 single (keep)
    assert keep.tolist() == [False, False, True, True, False, False, True]
    assert keep.dtype == torch.bool



def test_filter_groups_bad_input():
    with pytest.raises(ValueError, match=r"filter_groups: group_ids must have shape \(3,\)"):
        algos.filter_groups(t([1.0, 2.0, 3.0]), torch.tensor([0, 1]))
