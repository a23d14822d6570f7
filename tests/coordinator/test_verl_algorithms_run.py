"""VeRL's advantage estimators and a policy loss with settings of its own, by their config names, through a
real training step on the in-process mesh: one mesh whose actor trains with loss_mode clip_cov and whose
reward function returns two components beside its score, one StartRun (one step) per estimator. The
advantages the actor receives are the named estimator's on the step's scores, groups and (gdpo) reward
components, read back from the rollout dump (the optimal token baselines: and on the old log-probs and sum of
squared probabilities the actor's log-prob pass gave), and clip_cov cuts the share of tokens actor.clip_cov_ratio says,
so a name or a setting that does not reach its function fails here."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.rollout_batch import token_level_scores
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process

pytestmark = pytest.mark.slow

ESTIMATORS = ("grpo_passk", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_vectorized", "rloo_vectorized",
              "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline")
OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")
GDPO = ["algorithm.gdpo_reward_keys=[exact,early]", "algorithm.gdpo_reward_weights=[1.0,0.5]"]
CUT_RATIO = 0.5
# The quickstart's task scored exactly, and two components: that score, and one apart from it (the answer
# starts early in the alphabet), so that GDPO's normalizing them one by one shows.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    exact, early = float(solution_str.strip() == ground_truth), float(solution_str.strip()[:1] < "D")
    return {"score": exact, "exact": exact, "early": early}
"""


def components(row: dict) -> list[float]:
    response = row["response"].strip()
    return [float(response == row["ground_truth"]), float(response[:1] < "D")]


class RecordingActor:
    """The run's actor client, keeping each UpdatePolicy batch and each ComputeLogProbs answer with
    sum_pi_squared; everything else passes through."""

    def __init__(self, actor):
        self.actor = actor
        self.batches: list[dict[str, torch.Tensor]] = []
        self.squares: list[torch.Tensor] = []

    async def compute_log_probs(self, *args, **kwargs):
        outputs = await self.actor.compute_log_probs(*args, **kwargs)
        if "sum_pi_squared" in outputs:
            self.squares.append(outputs["sum_pi_squared"])
        return outputs

    def __getattr__(self, name):
        return getattr(self.actor, name)

    async def update_policy(self, batch, *args, **kwargs):
        self.batches.append(batch)
        return await self.actor.update_policy(batch, *args, **kwargs)


def test_each_estimator_and_clip_cov_train_by_their_config_names(tiny_model, tmp_path):
    # Every valid token a candidate (lower bound far below any covariance): clip_cov cuts int(ratio * tokens)
    # of them in each micro-batch, where vanilla PPO would clip none in a step's first optimizer step.
    (tmp_path / "reward.py").write_text(REWARD)
    config = fast_config(tiny_model, "actor.loss_mode=clip_cov", f"actor.clip_cov_ratio={CUT_RATIO}",
                         "actor.clip_cov_lb=-1e9", "trainer.total_steps=1", "trainer.dump_rollouts=true",
                         f"reward.custom_path={tmp_path / 'reward.py'}")
    actors: list[RecordingActor] = []

    def recording(peers):
        actors.append(RecordingActor(peers.actor))
        return dataclasses.replace(peers, actor=actors[-1])

    async def scenario():
        results = {}
        async with in_process(config, tmp_path / "run", wrap_peers=recording) as client:
            for name in ESTIMATORS:
                await client.start_run([f"algorithm.adv_estimator={name}", f"trainer.experiment_name={name}",
                                        *(GDPO if name == "gdpo" else [])])
                metrics = [dict(update.metrics) async for update in client.stream_metrics(from_step=1)]
                results[name] = metrics, await client.run_status()
        return results

    results = asyncio.run(scenario())
    batches = [batch for actor in actors for batch in actor.batches]
    assert len(batches) == len(ESTIMATORS)  # one update a run
    squares = dict(zip(OTB, [square for actor in actors for square in actor.squares], strict=True))  # asked by OTB only
    for name, batch in zip(ESTIMATORS, batches, strict=True):
        metrics, status = results[name]
        assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, (name, status.error)
        assert CUT_RATIO - 0.1 < metrics[-1]["actor/pg_clipfrac"] <= CUT_RATIO, name
        rows = [json.loads(line) for line in
                (tmp_path / "run" / "experiments" / name / "rollouts" / "step_1.jsonl").read_text().splitlines()]
        mask = batch["response_mask"]
        scores = torch.tensor([row["score"] for row in rows], dtype=torch.float32)
        uids = [row["uid"] for row in rows]
        group_ids = torch.tensor([uids.index(uid) for uid in uids])
        extra = {"gdpo": {"reward_components": torch.tensor([components(row) for row in rows]),
                          "gdpo_reward_weights": [1.0, 0.5]}}
        if name in OTB:
            pi = batch["old_log_probs"].exp()
            assert ((squares[name] >= pi**2 - 1e-6) & (squares[name] <= 1 + 1e-6)).all(), name  # a sum of pi(v)^2
            assert squares[name][mask.bool()].min() < 0.99, name  # not all one-hot: a baseline weighs something
            extra[name] = {"old_log_probs": batch["old_log_probs"], "sum_pi_squared": squares[name]}
        expected, _ = algos.get_advantage_estimator(name)(
            token_rewards=token_level_scores(scores, mask), mask=mask, group_ids=group_ids, norm_by_std=True,
            **extra.get(name, {}))
        torch.testing.assert_close(batch["advantages"], expected, msg=name)
        if name == "gdpo":  # not what the score alone gives: the components arrived
            score_only, _ = algos.compute_gdpo_advantage(token_level_scores(scores, mask), mask, group_ids)
            assert not torch.allclose(expected, score_only)
    passk = batches[0]["advantages"].abs().sum(-1) > 0  # [B] grpo_passk: the best of each group of 4 at most
    assert int(passk.view(-1, 4).sum(-1).max()) <= 1
