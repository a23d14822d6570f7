"""The scale settings through the whole loop (issue 33's "through rlfabric train or the in-process mesh"): the
quickstart's GRPO run on the in-process mesh still learns the task (< 0.3 -> > 0.8) with

- the tiny Qwen3-MoE quickstart model (make_quickstart_model(moe=True)), its micro-batches packed;
- a tensor-parallel actor (actor.world_size 2 = one TP group of 2 ranks, DTensor x FSDP2), packed;

and at every step the actor's log-probs of the sampled tokens (a separate forward pass,
algorithm.old_log_prob_source=actor) are the rollout's: the packed, sharded or expert-routed forward
and the weight sync of the step before agree with the hf engine's plain forward."""

from __future__ import annotations

import pytest

from rlfabric.core.config import load_config
from rlfabric.quickstart.cached import cached_quickstart_model
from tests.coordinator.meshes import in_process, run_to_end

pytestmark = pytest.mark.slow

STEPS = 8  # the quickstart passes 0.8 by step ~4 (its 15 steps keep a wide margin)


def learn(tmp_path, *overrides: str, moe: bool = False) -> list[dict[str, float]]:
    config = load_config(None, [f"model.path={cached_quickstart_model(moe=moe)}", f"trainer.total_steps={STEPS}",
                                "algorithm.old_log_prob_source=actor", "actor.use_remove_padding=true",
                                "trainer.progress_bar=false", "trainer.plot=false", "trainer.loggers=[jsonl]",
                                *overrides])
    metrics, _ = run_to_end(in_process, config, tmp_path / "run")
    return list(metrics.values())


def assert_learns_with_the_rollouts_log_probs(metrics: list[dict[str, float]]) -> None:
    scores = [m["critic/score/mean"] for m in metrics]
    assert len(scores) == STEPS
    assert scores[0] < 0.3 and sum(scores[-3:]) / 3 > 0.8, scores
    k3 = [m["rollout_corr/k3_kl"] for m in metrics]
    assert max(k3) < 1e-4, k3


def test_the_moe_quickstart_model_learns_the_task_packed(tmp_path):
    assert_learns_with_the_rollouts_log_probs(learn(tmp_path, moe=True))


def test_a_tensor_parallel_actor_learns_the_task_packed(tmp_path):
    metrics = learn(tmp_path, "actor.world_size=2", "actor.tensor_parallel_size=2")
    assert_learns_with_the_rollouts_log_probs(metrics)
