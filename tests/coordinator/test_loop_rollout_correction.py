"""Where the PPO ratio's old log-probs come from (algorithm.old_log_prob_source) and rollout correction,
on the real driver (PPODriver) over the stand-in services of test_loop.py: which actor calls a step makes and
what its update is sent.

Each sample's two tokens have rollout log-probs -0.5 and -1.0; the stand-in actor's log-probs are 0, so
the ratios pi_old / pi_rollout are e^0.5 ~ 1.65 and e^1 ~ 2.72.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.rollout_batch import RolloutBatch, build_rollout_batch
from rlfabric.core.config import ConfigError, RunConfig, apply_override, check_run_rules, config_from_dict
from rlfabric.core.errors import FailedPrecondition
from rlfabric.rollout.types import Finish, FinishedSample
from tests.coordinator.test_loop import PROMPTS, ROWS, ModelService, N, driver_over, train_step

ROLLOUT_LOG_PROBS = [-0.5, -1.0]
SUM_PI_SQUARED = 0.75


class CountingActor(ModelService):
    """The stand-in actor, counting its ComputeLogProbs calls; asked for sum_pi_squared, it gives SUM_PI_SQUARED."""

    def __init__(self):
        super().__init__("actor")
        self.forward_calls = 0
        self.asked_sum_pi_squared = False

    async def compute_log_probs(self, tensors, temperature, compute_entropy=True, compute_sum_pi_squared=False):
        self.forward_calls += 1
        self.asked_sum_pi_squared = compute_sum_pi_squared
        outputs = await super().compute_log_probs(tensors, temperature, compute_entropy)
        if compute_sum_pi_squared:
            outputs["sum_pi_squared"] = torch.full(tensors["responses"].shape, SUM_PI_SQUARED)
        return outputs


def config(*overrides: str) -> RunConfig:
    """One optimizer step per batch (the mini-batch is the whole batch), unless an override says otherwise."""
    tree = {"data": {"train_batch_size": PROMPTS}, "rollout": {"n": N}, "actor": {"ppo_mini_batch_size": PROMPTS},
            "trainer": {"dump_rollouts": False, "total_steps": 3}}
    for override in overrides:
        apply_override(tree, override)
    return config_from_dict(tree)


def batch(with_log_probs: bool = True) -> RolloutBatch:
    log_probs = ROLLOUT_LOG_PROBS if with_log_probs else []
    samples = [FinishedSample(p, i, [4, 5], log_probs, Finish.STOP, 0) for p in range(PROMPTS) for i in range(N)]
    rollout = build_rollout_batch(ROWS, samples, N, pad_token_id=0)
    rollout.scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    rollout.score_failed = torch.zeros(4, dtype=torch.bool)
    return rollout


def step(tmp_path, *overrides: str, rollout: RolloutBatch | None = None, actor: CountingActor | None = None):
    """One train_step: (its metrics, the actor's forward calls, the batch its update was sent)."""
    actor = actor or CountingActor()
    metrics = train_step(driver_over(config(*overrides), tmp_path, actor), rollout or batch())
    return metrics, actor.forward_calls, actor.updates[0]


def test_the_rollout_log_probs_enter_the_batch():
    assert batch().rollout_log_probs.tolist() == [ROLLOUT_LOG_PROBS] * 4
    assert batch(with_log_probs=False).rollout_log_probs is None  # e.g. an engine that gives none


def test_one_optimizer_step_skips_the_old_log_prob_forward_pass(tmp_path):
    metrics, forward_calls, sent = step(tmp_path)
    assert forward_calls == 0 and "old_log_probs" not in sent  # the actor takes its own inside the step
    assert metrics["perf/old_log_prob_forward"] == 0.0
    assert "timing_s/old_log_prob" not in metrics
    assert not any(key.startswith("rollout_corr/") for key in metrics)  # nothing to compare the rollout with


def test_two_epochs_need_the_forward_pass_and_report_the_mismatch(tmp_path):
    metrics, forward_calls, sent = step(tmp_path, "actor.ppo_epochs=2")
    assert forward_calls == 1 and "old_log_probs" in sent and "rollout_is_weights" not in sent
    assert metrics["perf/old_log_prob_forward"] == 1.0
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.75)  # mean(rollout - old) = mean(-0.5, -1.0)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.e, rel=1e-5)


def test_source_actor_always_runs_the_forward_pass(tmp_path):
    metrics, forward_calls, _ = step(tmp_path, "algorithm.old_log_prob_source=actor")
    assert forward_calls == 1 and metrics["perf/old_log_prob_forward"] == 1.0
    assert "rollout_corr/k3_kl" in metrics  # so a one-step run can see its mismatch


def test_source_rollout_uses_the_samplers_log_probs_without_a_forward_pass(tmp_path):
    metrics, forward_calls, sent = step(tmp_path, "algorithm.old_log_prob_source=rollout", "actor.ppo_epochs=2")
    assert forward_calls == 0
    assert sent["old_log_probs"].tolist() == [ROLLOUT_LOG_PROBS] * 4
    assert metrics["perf/old_log_prob_forward"] == 0.0
    assert not any(key.startswith("rollout_corr/") for key in metrics)  # old == rollout: no gap to measure


def test_source_rollout_without_rollout_log_probs_fails_naming_the_key(tmp_path):
    with pytest.raises(FailedPrecondition, match="algorithm.old_log_prob_source=rollout needs the rollout's"):
        step(tmp_path, "algorithm.old_log_prob_source=rollout", rollout=batch(with_log_probs=False))


def test_source_rollout_and_a_correction_cannot_be_combined():
    with pytest.raises(ConfigError, match="no mismatch left to correct"):
        check_run_rules(config("algorithm.old_log_prob_source=rollout",
                               "algorithm.rollout_correction.rollout_is=token"))


def test_token_tis_sends_the_weights_with_the_update(tmp_path):
    metrics, forward_calls, sent = step(tmp_path, "algorithm.rollout_correction.rollout_is=token")
    assert forward_calls == 1  # the weights need the old log-probs before the update, even in one step
    expected = torch.tensor([[math.exp(0.5), 2.0]] * 4)  # min(r, 2)
    torch.testing.assert_close(sent["rollout_is_weights"], expected)
    assert sent["response_mask"].sum().item() == 8  # nothing rejected
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


def test_token_rejection_leaves_the_rejected_tokens_out_of_the_update(tmp_path):
    metrics, _, sent = step(tmp_path, "algorithm.rollout_correction.rollout_rs=token")  # keeps r in [0.5, 2]
    assert sent["response_mask"].tolist() == [[1, 0]] * 4  # e^1 > 2: every second token is out
    assert "rollout_is_weights" not in sent
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_optimal_token_baselines_get_the_actors_pass_and_the_is_weights(tmp_path, name):
    actor = CountingActor()
    # The second sample of each prompt was sampled closer to the trainer's policy: its IS weights are smaller.
    rollout_log_probs = {0: ROLLOUT_LOG_PROBS, 1: [-0.1, -0.2]}
    samples = [FinishedSample(p, i, [4, 5], rollout_log_probs[i], Finish.STOP, 0) for p in range(PROMPTS)
               for i in range(N)]
    rollout = build_rollout_batch(ROWS, samples, N, pad_token_id=0)
    rollout.scores, rollout.score_failed = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.bool)
    _, forward_calls, sent = step(tmp_path, f"algorithm.adv_estimator={name}",
                                  "algorithm.rollout_correction.rollout_is=token", rollout=rollout, actor=actor)
    assert forward_calls == 1 and actor.asked_sum_pi_squared  # one optimizer step, yet the estimator reads them
    inputs = {"token_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]] * 2), "mask": torch.ones(4, 2),
              "group_ids": torch.tensor([0, 0, 1, 1]), "old_log_probs": torch.zeros(4, 2),
              "sum_pi_squared": torch.full((4, 2), SUM_PI_SQUARED)}
    weights = torch.tensor([[math.exp(0.5), 2.0], [math.exp(0.1), math.exp(0.2)]] * 2)  # min(pi_old / pi_rollout, 2)
    expected, _ = algos.get_advantage_estimator(name)(**inputs, rollout_is_weights=weights)
    torch.testing.assert_close(sent["advantages"], expected)
    unweighted, _ = algos.get_advantage_estimator(name)(**inputs)
    assert (expected - unweighted).abs().min() > 0.05  # the weights reached the estimator


def test_the_bypass_mode_loss_takes_the_rollouts_log_probs_and_corrects_in_the_loss(tmp_path):
    metrics, forward_calls, sent = step(tmp_path, "actor.loss_mode=bypass_mode", "algorithm.old_log_prob_source=rollout",
                                        "algorithm.rollout_correction.rollout_is=token",
                                        "algorithm.rollout_correction.loss_type=reinforce", "actor.ppo_epochs=2")
    assert forward_calls == 0 and sent["old_log_probs"].tolist() == [ROLLOUT_LOG_PROBS] * 4
    assert "rollout_is_weights" not in sent  # the loss takes them against the policy it updates
    assert metrics["perf/old_log_prob_forward"] == 0.0


@pytest.mark.parametrize(("overrides", "error"), [
    (["actor.loss_mode=bypass_mode"], "set algorithm.old_log_prob_source to rollout"),
    (["algorithm.rollout_correction.loss_type=reinforce"], "applies to actor.loss_mode=bypass_mode only"),
    (["algorithm.adv_estimator=optimal_token_baseline", "algorithm.old_log_prob_source=rollout"],
     "needs the actor's log-prob pass"),
])
def test_what_reads_the_old_log_probs_is_checked_against_their_source(overrides, error):
    with pytest.raises(ConfigError, match=error):
        check_run_rules(config(*overrides))
    check_run_rules(config("actor.loss_mode=bypass_mode", "algorithm.old_log_prob_source=rollout",
                           "algorithm.rollout_correction.rollout_rs=token"))  # the loss corrects: allowed
