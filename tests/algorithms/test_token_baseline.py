"""The optimal token baselines' own properties (their values against VeRL's: test_verl_parity.py)."""

import pytest
import torch

from rlfabric import algorithms as algos

F64 = torch.float64


def _batch(lengths: list[int], scores: list[float], width: int = 6) -> dict[str, torch.Tensor]:
    """Outcome rewards on each response's last token, one group per 3 rows, and a policy whose every token
    has the same gradient norm: pi_t = 0.5 and sum pi^2 = 0.5, so ||s_t||^2 = 0.5."""
    lengths_t = torch.tensor(lengths)
    mask = (torch.arange(width)[None, :] < lengths_t[:, None]).to(F64)
    rewards = torch.zeros(len(lengths), width, dtype=F64)
    rewards[torch.arange(len(lengths)), lengths_t - 1] = torch.tensor(scores, dtype=F64)
    return {"token_rewards": rewards, "mask": mask, "group_ids": torch.arange(len(lengths)) // 3,
            "old_log_probs": torch.full_like(mask, 0.5).log(), "sum_pi_squared": torch.full_like(mask, 0.5)}


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_equal_gradient_norms_and_lengths_give_the_group_mean_baseline(name):
    batch = _batch([4, 4, 4, 5, 5, 5], [1.0, 0.0, 0.5, 0.25, 1.0, 1.0])
    advantages, returns = algos.get_advantage_estimator(name)(**batch)
    dr_grpo, _ = algos.compute_grpo_advantage(batch["token_rewards"], batch["mask"], batch["group_ids"],
                                              norm_by_std=False)
    # W_t is the same for every response, so B_t is the plain group mean of the returns: Dr. GRPO's baseline.
    torch.testing.assert_close(advantages, dr_grpo, rtol=0, atol=1e-7)
    torch.testing.assert_close(returns, batch["token_rewards"].flip(-1).cumsum(-1).flip(-1), rtol=0, atol=0)


def test_the_single_longest_response_has_no_baseline_past_the_others():
    batch = _batch([2, 3, 5, 4, 4, 1], [1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    advantages, returns = algos.compute_optimal_token_baseline_advantage(**batch)
    # Row 2 is its group's only longest response: past position 3 (the second-longest) its advantage is its return.
    torch.testing.assert_close(advantages[2, 3:5], returns[2, 3:5], rtol=0, atol=0)
    assert advantages[2, :3].ne(returns[2, :3]).all()  # before, the group's baseline applies
    kept, _ = algos.compute_optimal_token_baseline_advantage(**batch, handle_zero_tail=False)
    assert kept[2, 3:5].ne(returns[2, 3:5]).all()  # without it, the baseline there is row 2's own return ...
    torch.testing.assert_close(kept[2, 3:5], torch.zeros(2, dtype=F64), rtol=0, atol=1e-7)  # ... and A = 0
    # Group 2 has two longest responses (4 and 4): no tail is zeroed there.
    torch.testing.assert_close(advantages[3:], kept[3:], rtol=0, atol=0)


def test_tir_lines_responses_up_by_trained_token():
    batch = _batch([5, 5, 5, 3, 3, 3], [1.0, 0.0, 0.5, 1.0, 0.0, 0.0])
    holes = batch["mask"].clone()
    holes[0, 1:3] = 0  # row 0: two tool tokens inside its response
    with_holes = {**batch, "mask": holes}
    tir, _ = algos.compute_tir_optimal_token_baseline_advantage(**with_holes)
    by_position, _ = algos.compute_optimal_token_baseline_advantage(**with_holes)
    # Without holes the two agree; with them, row 0's 2nd trained token (position 3) meets the others' 2nd.
    same, _ = algos.compute_tir_optimal_token_baseline_advantage(**batch)
    torch.testing.assert_close(same, algos.compute_optimal_token_baseline_advantage(**batch)[0], rtol=0, atol=1e-12)
    assert not torch.allclose(tir[:3], by_position[:3])
    assert (tir * (1 - holes)).abs().sum() == 0  # no advantage on the environment's tokens


def test_is_weights_scale_each_tokens_share_of_the_baseline():
    batch = _batch([4, 4, 4], [1.0, 0.0, 0.0])
    weights = torch.ones_like(batch["mask"])
    weights[0] = 3.0  # row 0's tokens count 9x (rho^2): the baseline moves towards its return
    plain, _ = algos.compute_optimal_token_baseline_advantage(**batch)
    weighted, _ = algos.compute_optimal_token_baseline_advantage(**batch, rollout_is_weights=weights)
    torch.testing.assert_close(1 - weighted[0, 0], torch.tensor(9 / 11, dtype=F64))  # B = 9 / (9 + 1 + 1)
    assert weighted[0, 0] < plain[0, 0]


def test_missing_inputs_name_themselves():
    batch = _batch([2, 2, 2], [1.0, 0.0, 0.0])
    del batch["sum_pi_squared"]
    with pytest.raises(ValueError, match="needs sum_pi_squared"):
        algos.get_advantage_estimator("optimal_token_baseline")(**batch)
