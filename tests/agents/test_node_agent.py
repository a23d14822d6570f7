"""The Node.js agent (examples/agents/node/lookup_agent.mjs: the plain `openai` npm package, no rlfabric code)
trains unchanged under agent.runner command (issue 47's acceptance row): each episode is `node lookup_agent.mjs`
with the task on stdin and OPENAI_BASE_URL / OPENAI_API_KEY set; the gateway records its calls, the reward
service scores its answers, and the actor updates on them. On the in-process mesh with the lookup warm start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlfabric.core.config import load_config
from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.quickstart.cached import cached_lookup_model
from rlfabric.quickstart.lookup_warm_start import LEARNER
from rlfabric.v1 import coordinator_pb2
from tests.agents.node import AGENT, NO_NODE, NODE, install_node_agent

PROMPTS, N, STEPS = 4, 4, 2

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NODE is None, reason=NO_NODE)]

LOOKUP = Path(__file__).parents[2] / "examples" / "agents" / "lookup.yaml"


def train(model: Path, run_dir: Path, *overrides: str) -> tuple[list[dict], object]:
    """A run of examples/agents/lookup.yaml from `model` on the in-process mesh: (its metrics, its final status)."""
    config = load_config(LOOKUP, [f"model.path={model}", "trainer.progress_bar=false", "trainer.plot=false",
                                  "trainer.loggers=[jsonl]", *overrides])

    async def run():
        async with InProcessMesh(config, run_dir) as mesh:
            await mesh.coordinator.start_run()
            async for _ in mesh.coordinator.stream_metrics(from_step=1):
                pass
            return await mesh.coordinator.run_status()

    status = asyncio.run(run())
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], status


def test_the_node_agent_trains_unchanged_under_the_command_runner(tmp_path):
    install_node_agent()
    steps, status = train(
        cached_lookup_model(**LEARNER), tmp_path / "run", "agent.runner=command", "agent.entrypoint=",
        f"agent.command=[{NODE},{AGENT}]", f"data.train_batch_size={PROMPTS}",
        f"actor.ppo_mini_batch_size={PROMPTS}", f"rollout.n={N}", f"trainer.total_steps={STEPS}",
        "trainer.export_final=false")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    training = [step for step in steps if "critic/score/mean" in step]
    assert len(training) == STEPS
    for step in training:
        assert step["agent/episodes"] == PROMPTS * N and not any(key.startswith("agent/failed/") for key in step)
        assert step["agent/calls"] >= PROMPTS * N  # every episode asked the model at least once, through the gateway
        assert step["agent/segments"] >= 1 and step["actor/grad_norm"] > 0  # its recorded tokens were trained on
