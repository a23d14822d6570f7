"""Short runs on the in-process mesh: with rollout correction on (token TIS and token rejection) a run
completes and every step reports the rollout/trainer mismatch, in the step metrics and in Prometheus;
each algorithm.old_log_prob_source makes the actor forward passes it says, counted at the actor's client."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process
from tests.numerics import ENGINE_LOGPROB_GAP


class CountingActor:
    """The run's actor client, counting its ComputeLogProbs calls; everything else passes through."""

    def __init__(self, actor):
        self.actor = actor
        self.forward_calls = 0

    def __getattr__(self, name):
        return getattr(self.actor, name)

    async def compute_log_probs(self, *args, **kwargs):
        self.forward_calls += 1
        return await self.actor.compute_log_probs(*args, **kwargs)


@pytest.mark.numerics
def test_a_run_with_rollout_correction_reports_the_mismatch(tiny_model, tmp_path):
    config = fast_config(tiny_model, "algorithm.rollout_correction.rollout_is=token",
                         "algorithm.rollout_correction.rollout_rs=token",
                         "algorithm.rollout_correction.rollout_rs_threshold=10.0")

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            await mesh.coordinator.start_run()
            metrics = {update.step: dict(update.metrics)
                       async for update in mesh.coordinator.stream_metrics(from_step=1)}
            gauge = mesh.controller.registry.get_sample_value("rlfabric_coordinator_metric",
                                                              {"name": "rollout_corr/kl"})
            return metrics, await mesh.coordinator.run_status(), gauge

    metrics, status, gauge = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    for step in (1, 2):
        step_metrics = metrics[step]
        # The hf engine samples in float32 from the weights the actor has: the two policies agree to a few float32
        # steps per token (tests/numerics.py), so the mean log-ratio is within the engines' gap, k3 (~ d^2 / 2)
        # within its square and the IS weights within exp(gap) - 1 ~ gap of 1.
        assert step_metrics["perf/old_log_prob_forward"] == 1.0  # the weights need the old log-probs
        assert abs(step_metrics["rollout_corr/kl"]) <= ENGINE_LOGPROB_GAP
        assert 0 <= step_metrics["rollout_corr/k3_kl"] <= ENGINE_LOGPROB_GAP**2
        assert step_metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=ENGINE_LOGPROB_GAP)
        assert step_metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
        assert step_metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert gauge == pytest.approx(metrics[2]["rollout_corr/kl"])  # the last step's, by its VeRL name
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"rollout_corr/rollout_is_weights_mean"' in lines


@pytest.mark.parametrize("overrides, forward_calls", [
    ((), 0),  # one optimizer step a batch (fast_config): the actor takes its own old log-probs in it
    (("algorithm.old_log_prob_source=actor",), 2),  # one forward pass a step
    (("algorithm.old_log_prob_source=rollout", "actor.ppo_epochs=2"), 0),  # the sampler's log-probs
], ids=["auto", "actor", "rollout"])
def test_old_log_prob_sources_make_the_forward_passes_they_say(tiny_model, tmp_path, overrides, forward_calls):
    config = fast_config(tiny_model, *overrides)
    actors: list[CountingActor] = []

    def counting(peers):
        actors.append(CountingActor(peers.actor))
        return dataclasses.replace(peers, actor=actors[-1])

    async def scenario():
        async with in_process(config, tmp_path / "run", wrap_peers=counting) as client:
            await client.start_run()
            metrics = {update.step: dict(update.metrics) async for update in client.stream_metrics(from_step=1)}
            return metrics, await client.run_status()

    metrics, status = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert actors[0].forward_calls == forward_calls
    for step in (1, 2):
        assert metrics[step]["perf/old_log_prob_forward"] == float(forward_calls > 0)
        assert metrics[step]["actor/grad_norm"] > 0 and math.isfinite(metrics[step]["actor/pg_loss"])  # it trains
        assert ("rollout_corr/kl" in metrics[step]) == (forward_calls > 0)
