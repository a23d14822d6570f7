"""Multi-turn runs on the lookup task: the coordinator asks the rollout for agent loops against the
environment service, trains on the model's tokens only, scores from the environment (or the reward
service, or both), and reports agent/* metrics; on the in-process mesh and over gRPC."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import MESHES, fast_config

MULTI_TURN = ["data.builtin_task=lookup", "env.enable=true", "rollout.multi_turn.enable=true",
              "rollout.multi_turn.max_turns=2", "data.max_prompt_length=96", "data.max_response_length=24",
              "trainer.dump_rollouts=true"]


def run(mesh_kind, config, run_dir):
    async def scenario():
        async with MESHES[mesh_kind](config, run_dir) as coordinator:
            await coordinator.start_run()
            metrics = {update.step: dict(update.metrics) async for update in coordinator.stream_metrics(from_step=1)}
            return metrics, await coordinator.run_status()

    return asyncio.run(scenario())


@pytest.mark.parametrize("mesh_kind", ["in-process", "grpc"])
def test_a_multi_turn_run_trains_and_reports_agent_metrics(tiny_model, tmp_path, mesh_kind):
    config = fast_config(tiny_model, *MULTI_TURN)
    metrics, status = run(mesh_kind, config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    for step in (1, 2):
        step_metrics = metrics[step]
        assert 1 <= step_metrics["agent/turns/mean"] <= 2
        assert step_metrics["agent/env_failed/count"] == 0
        assert step_metrics["critic/score/mean"] == pytest.approx(step_metrics["agent/env_reward/mean"])
        assert 0 < step_metrics["agent/model_token_fraction"] <= 1
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"agent/tool_calls/mean"' in lines and '"agent/env_seconds/mean"' in lines


def test_a_dead_environment_fails_its_samples_not_the_run(tiny_model, tmp_path):
    config = fast_config(tiny_model, *MULTI_TURN, "env.enable=false", "rollout.multi_turn.env_address=127.0.0.1:9",
                         "rollout.multi_turn.env_timeout_s=1")
    metrics, status = run("in-process", config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert metrics[1]["agent/env_failed/count"] == 32  # every sample: left out of training, the run goes on
    assert metrics[1]["reward/score_failed/count"] == 32
    dumped = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert all(row["score_failed"] for row in dumped)
