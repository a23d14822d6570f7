"""The tiny model learns to use a tool by RL: on the lookup task (rlfabric.env.lookup) the answer is only in
the tool's reply, and a guess is right one time in ten.

The model is warm-started to write the call but, mostly, to guess (make_lookup_model's call_fraction), so
it starts near the guess's score. GRPO over multi-turn agent loops (examples/lookup_multi_turn.yaml, on
the in-process mesh with the environment service) then has to find out that calling the tool pays:
validation (greedy) goes from below 0.3 to above 0.8, and so does the share of samples that call.
"""

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

EXAMPLE = Path(__file__).parents[2] / "examples" / "lookup_multi_turn.yaml"
STEPS = 12


@pytest.fixture(scope="module")
def reluctant_model() -> Path:
    """Knows the call's format (1000 demonstration steps), then calls in 10% of episodes (100 more); built
    once per machine (the model cache)."""
    return cached_lookup_model(**LEARNER)


def test_grpo_teaches_the_tiny_model_to_use_the_tool(reluctant_model, tmp_path):
    config = load_config(EXAMPLE, [f"model.path={reluctant_model}", "actor.lr=5e-4", f"trainer.total_steps={STEPS}",
                                   "trainer.val_before_train=true", f"trainer.test_freq={STEPS}",
                                   "trainer.progress_bar=false", "trainer.plot=false", "trainer.loggers=[jsonl]"])

    async def train():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            await mesh.coordinator.start_run()
            async for _ in mesh.coordinator.stream_metrics(from_step=1):
                pass
            return await mesh.coordinator.run_status()

    status = asyncio.run(train())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validations = [step["val/score/mean"] for step in steps if "val/score/mean" in step]
    training = [step for step in steps if "critic/score/mean" in step]
    assert len(validations) == 2 and len(training) == STEPS
    print("val", validations, "train", [round(step["critic/score/mean"], 3) for step in training],
          "calls", [round(step["agent/tool_calls/mean"], 2) for step in training])

    before, after = validations
    assert before < 0.3, "the warm start should leave a model that mostly guesses"
    assert after > 0.8
    # sampled at temperature 1 the policy learns the same thing: it calls the tool and scores
    assert training[0]["agent/tool_calls/mean"] < 0.3 and training[-1]["agent/tool_calls/mean"] > 0.9
    assert training[0]["critic/score/mean"] < 0.3 and training[-1]["critic/score/mean"] > 0.7
    # the environment's tokens are never trained on
    assert all(0 < step["agent/model_token_fraction"] < 1 for step in training[-3:])
