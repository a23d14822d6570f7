"""A short run with rollout correction on (token TIS and token rejection) on the in-process mesh: it
completes, and every step reports the rollout/trainer mismatch, in the step metrics and in Prometheus."""

from __future__ import annotations

import asyncio

import pytest

from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config


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
        # The hf engine samples in float32 from the weights the actor has: the two policies agree closely.
        assert step_metrics["perf/old_log_prob_forward"] == 1.0  # the weights need the old log-probs
        assert abs(step_metrics["rollout_corr/kl"]) < 1e-3 and 0 <= step_metrics["rollout_corr/k3_kl"] < 1e-3
        assert step_metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-2)
        assert step_metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
        assert step_metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert gauge == pytest.approx(metrics[2]["rollout_corr/kl"])  # the last step's, by its VeRL name
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"rollout_corr/rollout_is_weights_mean"' in lines
