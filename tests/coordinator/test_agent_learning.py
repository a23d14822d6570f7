"""An unchanged openai-SDK agent (examples/agents/lookup_agent.py: no rlfabric import, its own tool loop) learns
to use its tool by GRPO through the gateway, as the environment-service version does
(test_multi_turn_learning.py): the lookup task's answer is only in the tool's reply, and the warm-started model
mostly guesses. Its calls are recorded as token ids, joined into segments and trained on."""

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

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples" / "agents"
STEPS = 12
TRAINED = 0.7  # the last step's training score
GUESS = 0.1  # a guessed digit's chance (rlfabric.env.lookup: a random digit per key)


@pytest.fixture(scope="module")
def reluctant_model() -> Path:
    """Writes the call's format but calls in about 10% of episodes (test_multi_turn_learning.py's start)."""
    return cached_lookup_model(**LEARNER)


def train(model: Path, run_dir: Path, *overrides: str) -> tuple[list[dict], object]:
    config = load_config(EXAMPLES / "lookup.yaml", [
        f"model.path={model}", f"agent.entrypoint={EXAMPLES / 'lookup_agent.py'}:run", "trainer.progress_bar=false",
        "trainer.plot=false", "trainer.loggers=[jsonl]", *overrides])

    async def run():
        async with InProcessMesh(config, run_dir) as mesh:
            await mesh.coordinator.start_run()
            async for _ in mesh.coordinator.stream_metrics(from_step=1):
                pass
            return await mesh.coordinator.run_status()

    status = asyncio.run(run())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return steps, status


def test_grpo_teaches_an_unchanged_openai_agent_to_use_its_tool(reluctant_model, tmp_path):
    steps, status = train(reluctant_model, tmp_path / "run", "agent.runner=inline", "actor.lr=5e-4",
                          f"trainer.total_steps={STEPS}", "trainer.val_before_train=true", f"trainer.test_freq={STEPS}")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    validations = [step["val/score/mean"] for step in steps if "val/score/mean" in step]
    training = [step for step in steps if "critic/score/mean" in step]
    print("val", validations, "train", [round(step["critic/score/mean"], 3) for step in training],
          "tool calls", [step["agent/tool_calls"] for step in training])
    before, after = validations
    assert before < 0.3, "the warm start should leave a model that mostly guesses"
    assert after > 0.8
    calling = [step["agent/tool_calls"] / step["agent/episodes"] for step in training]  # the last: validation's too
    assert training[0]["critic/score/mean"] < 0.3 and training[-1]["critic/score/mean"] > TRAINED
    # The digit is only in the tool's reply; a guess is right one time in ten. So a score above TRAINED needs
    # calls in more than (TRAINED - GUESS) / (1 - GUESS) of the episodes.
    assert calling[0] < 0.3 and calling[-1] > (TRAINED - GUESS) / (1 - GUESS), calling
    # a call, then the answer with the tool's reply between: one segment per episode, the reply not trained on
    assert training[-1]["agent/segments"] == training[-1]["agent/episodes"]
    assert training[-1]["agent/tool_parse_errors"] < 0.1 * training[-1]["agent/episodes"]


def test_the_agent_in_a_process_of_its_own_calls_its_tool_through_the_gateway(reluctant_model, tmp_path):
    steps, status = train(reluctant_model, tmp_path / "run", "agent.runner=subprocess", "data.train_batch_size=4",
                          "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.total_steps=1",
                          "trainer.export_final=false")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    (step,) = [step for step in steps if "critic/score/mean" in step]
    assert step["agent/episodes"] == 16 and "agent/failed/exited" not in step
    assert step["agent/calls"] >= 16 and step["agent/segments"] >= 1
