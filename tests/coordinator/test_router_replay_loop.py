"""MoE routing replay through the loop (actor.router_replay): on both meshes the bfloat16 hf rollout's routes reach
the float32 actor with the step's samples, and every step reports how many of them the actor would have chosen
itself (actor/router_agreement) beside the rollout/trainer gap (rollout_corr/*)."""

from __future__ import annotations

import pytest

from tests.coordinator.meshes import fast_config, in_process, over_grpc, run_to_end

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mesh", [in_process, over_grpc], ids=["in_process", "over_grpc"])
def test_each_step_replays_the_rollouts_routes_and_reports_their_agreement(tiny_moe_model, tmp_path, mesh):
    config = fast_config(tiny_moe_model, "actor.router_replay=true", "rollout.dtype=bfloat16",
                         "algorithm.old_log_prob_source=actor")
    metrics, status = run_to_end(mesh, config, tmp_path / "run")
    assert len(metrics) == 2, status
    for step in metrics.values():
        assert 0.5 < step["actor/router_agreement"] <= 1.0  # routes at the wrong tokens would agree ~1/6 of the time
        assert step["rollout_corr/log_prob_abs_diff"] > 0  # a bfloat16 rollout against a float32 actor
