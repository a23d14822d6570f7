"""Rollout correction against hand-computed cases: two sequences whose token ratios pi_old / pi_rollout are

    row 0: 1.0, 3.0, (7.0 on padding)      product 3.0
    row 1: 0.4, 1.8, 0.6                   product 0.432
"""

import math

import pytest
import torch

from rlfabric import algorithms as algos

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
RATIOS = torch.tensor([[1.0, 3.0, 7.0], [0.4, 1.8, 0.6]])
ROLLOUT = torch.full((2, 3), math.log(0.5))
OLD = ROLLOUT + RATIOS.log()
REAL = [1.0, 3.0, 0.4, 1.8, 0.6]  # the ratios of the real tokens


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


def correct(**settings) -> algos.RolloutCorrection:
    return algos.rollout_correction(OLD, ROLLOUT, MASK, **settings)


def test_metrics_compare_the_real_tokens_only():
    metrics = algos.mismatch_metrics(OLD, ROLLOUT, MASK)
    logs = [math.log(r) for r in REAL]
    assert metrics["rollout_corr/kl"] == pytest.approx(-sum(logs) / 5, abs=1e-6)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in REAL) / 5, abs=1e-6)
    row0, row1 = math.log(3.0) / 2, math.log(0.432) / 3  # log_ppl(rollout) - log_ppl(old) per sequence
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx((row0 + row1) / 2, abs=1e-6)
    assert metrics["rollout_corr/log_ppl_abs_diff"] == pytest.approx((abs(row0) + abs(row1)) / 2, abs=1e-6)
    assert metrics["rollout_corr/chi2_token"] == pytest.approx(13.76 / 5 - 1, abs=1e-5)
    assert metrics["rollout_corr/log_prob_abs_diff"] == pytest.approx(sum(map(abs, logs)) / 5, abs=1e-6)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(6.8 / 5, abs=1e-6)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(0.4, abs=1e-6)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0, abs=1e-5)  # not the padding's 7


def test_identical_log_probs_show_no_mismatch():
    metrics = algos.mismatch_metrics(ROLLOUT, ROLLOUT, MASK)
    assert metrics["rollout_corr/kl"] == metrics["rollout_corr/k3_kl"] == metrics["rollout_corr/chi2_token"] == 0
    assert metrics["rollout_corr/log_prob_abs_diff"] == 0
    assert metrics["rollout_corr/rollout_is_min"] == metrics["rollout_corr/rollout_is_max"] == 1


def test_off_gives_the_metrics_and_changes_nothing():
    result = correct()
    assert result.weights is None
    assert torch.equal(result.mask, MASK)
    assert result.metrics == algos.mismatch_metrics(OLD, ROLLOUT, MASK)


def test_token_level_truncated_is():
    result = correct(rollout_is="token", rollout_is_threshold=2.0)
    close(result.weights, [[1.0, 2.0, 0.0], [0.4, 1.8, 0.6]])  # min(r, 2); 0 on padding
    assert torch.equal(result.mask, MASK)
    assert result.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert result.metrics["rollout_corr/rollout_is_weights_mean"] == pytest.approx(5.8 / 5, abs=1e-6)


def test_sequence_level_truncated_is():
    result = correct(rollout_is="sequence", rollout_is_threshold=2.0)
    close(result.weights, [[2.0, 2.0, 0.0], [0.432, 0.432, 0.432]])  # min(prod r, 2) on every token
    assert result.metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)
    assert result.metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(3.0, abs=1e-5)
    assert result.metrics["rollout_corr/rollout_is_seq_min"] == pytest.approx(0.432, abs=1e-6)
    assert result.metrics["rollout_corr/rollout_is_seq_mean"] == pytest.approx((3.0 + 0.432) / 2, abs=1e-5)


def test_token_level_rejection():
    result = correct(rollout_rs="token", rollout_rs_threshold=2.0)  # keeps r in [1/2, 2]
    assert result.weights is None
    assert result.mask.tolist() == [[1, 0, 0], [0, 1, 1]]  # 3.0 and 0.4 are out
    assert result.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0


def test_sequence_level_rejection_with_a_lower_bound_of_its_own():
    result = correct(rollout_rs="sequence", rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.4)
    assert result.mask.tolist() == [[0, 0, 0], [1, 1, 1]]  # product 3.0 is out, 0.432 is in
    assert result.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.5
    tighter = correct(rollout_rs="sequence", rollout_rs_threshold=4.0, rollout_rs_threshold_lower=0.5)
    assert tighter.mask.tolist() == [[1, 1, 0], [0, 0, 0]]


def test_truncation_and_rejection_together():
    result = correct(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_threshold=2.0)
    close(result.weights, [[1.0, 1.5, 0.0], [0.4, 1.5, 0.6]])  # weights are not zeroed by the rejection
    assert result.mask.tolist() == [[1, 0, 0], [0, 1, 1]]


def test_a_long_sequence_cannot_overflow():
    old = torch.zeros(1, 100)
    rollout = torch.full((1, 100), -1.0)  # every token e times likelier under the trainer: product e^100
    result = algos.rollout_correction(old, rollout, torch.ones(1, 100), rollout_is="sequence",
                                      rollout_is_threshold=5.0)
    assert torch.isfinite(result.weights).all() and result.weights.max() == 5.0
    assert result.metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(math.exp(20), rel=1e-4)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown rollout_is 'geometric'"):
        correct(rollout_is="geometric")
    with pytest.raises(ValueError, match="lower < upper"):
        correct(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)


def test_the_weights_multiply_each_tokens_policy_loss():
    advantages = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 1.0, 3.0]])
    weights = torch.tensor([[1.0, 2.0, 0.0], [0.4, 1.8, 0.6]])
    mask = MASK.float()
    for mode in ("vanilla", "gspo"):
        # old == new: ratio 1, nothing clipped, so each token's loss is -A (times its weight).
        loss, _ = algos.policy_loss(ROLLOUT, ROLLOUT, advantages, mask, agg="token-mean", mode=mode,
                                    rollout_is_weights=weights)
        close(loss, -(1 * 1 + 2 * 2 - 1 * 0.4 + 1 * 1.8 + 3 * 0.6) / 5)
        unweighted, _ = algos.policy_loss(ROLLOUT, ROLLOUT, advantages, mask, agg="token-mean", mode=mode)
        close(unweighted, -(1 + 2 - 1 + 1 + 3) / 5)
    with pytest.raises(ValueError, match="rollout_is_weights shape"):
        algos.policy_loss(ROLLOUT, ROLLOUT, advantages, mask, rollout_is_weights=torch.ones(2, 2))
