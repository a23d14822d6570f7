"""An unchanged openai-SDK agent (examples/agents/lookup_agent.py: no rlfabric import, AsyncOpenAI() from the
environment, its own tool loop) learns to use its tool by GRPO through the gateway, each episode a process of its
own (agent.runner subprocess, forked from the warm host), next to the same start trained through the environment
service (examples/lookup_multi_turn.yaml). The lookup task's answer is only in the tool's reply, and the
warm-started model mostly guesses; the agent's calls are recorded as token ids, joined into segments and trained
on."""

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

EXAMPLES = Path(__file__).parents[2] / "examples"
STEPS = 12  # the row: >= 0.8 within 20 steps
TRAINED = 0.7  # the last step's training score
GUESS = 0.1  # a guessed digit's chance (rlfabric.env.lookup: a random digit per key)


@pytest.fixture(scope="module")
def reluctant_model() -> Path:
    """Knows the call's format (1000 demonstration steps), then calls in about 10% of episodes (100 more); built
    once per machine (the model cache)."""
    return cached_lookup_model(**LEARNER)


def train(config_path: Path, model: Path, run_dir: Path, *overrides: str) -> tuple[list[dict], list[float]]:
    """STEPS steps of GRPO from `model`, validated (greedy) before and after: (the training steps' metrics, the
    two validation scores)."""
    config = load_config(
        config_path,
        [
            f"model.path={model}",
            "actor.lr=5e-4",
            f"trainer.total_steps={STEPS}",
            "trainer.val_before_train=true",
            f"trainer.test_freq={STEPS}",
            "trainer.progress_bar=false",
            "trainer.plot=false",
            "trainer.loggers=[jsonl]",
            *overrides,
        ],
    )

    async def run():
        async with InProcessMesh(config, run_dir) as mesh:
            await mesh.coordinator.start_run()
            async for _ in mesh.coordinator.stream_metrics(from_step=1):
                pass
            return await mesh.coordinator.run_status()

    status = asyncio.run(run())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [step["val/score/mean"] for step in steps if "val/score/mean" in step]
    training = [step for step in steps if "critic/score/mean" in step]
    assert len(validations) == 2 and len(training) == STEPS
    return training, validations


def test_grpo_teaches_the_tiny_model_to_use_the_tool_through_the_environment_service(
    reluctant_model, tmp_path
):
    training, (before, after) = train(EXAMPLES / "lookup_multi_turn.yaml", reluctant_model, tmp_path / "run")
    print(
        "val",
        [before, after],
        "train",
        [round(step["critic/score/mean"], 3) for step in training],
        "calls",
        [round(step["agent/tool_calls/mean"], 2) for step in training],
    )
    assert before < 0.3, "the warm start should leave a model that mostly guesses"
    assert after > 0.8
    # sampled at temperature 1 the policy learns the same thing: it calls the tool and scores
    assert training[0]["agent/tool_calls/mean"] < 0.3 and training[-1]["agent/tool_calls/mean"] > 0.9
    assert training[0]["critic/score/mean"] < 0.3 and training[-1]["critic/score/mean"] > TRAINED
    # the environment's tokens are never trained on
    assert all(0 < step["agent/model_token_fraction"] < 1 for step in training[-3:])


@pytest.mark.timeout(1800)  # 12 steps of forked agents: ~9 min at a load of 30-60 here
def test_grpo_teaches_an_unchanged_openai_agent_in_a_process_of_its_own(reluctant_model, tmp_path):
    training, (before, after) = train(
        EXAMPLES / "agents" / "lookup.yaml",
        reluctant_model,
        tmp_path / "run",
        f"agent.entrypoint={EXAMPLES / 'agents' / 'lookup_agent.py'}:run",
        "agent.runner=subprocess",
        "agent.subprocess.preload=true",
    )
    calling = [
        step["agent/tool_calls"] / step["agent/episodes"] for step in training
    ]  # the last: validation's too
    print(
        "val",
        [before, after],
        "train",
        [round(step["critic/score/mean"], 3) for step in training],
        "tool calls per episode",
        [round(share, 2) for share in calling],
        "step seconds",
        [round(step["timing_s/step"], 1) for step in training],
    )
    assert before < 0.3, "the warm start should leave a model that mostly guesses"
    assert after > 0.8
    assert training[0]["critic/score/mean"] < 0.3 and training[-1]["critic/score/mean"] > TRAINED
    # The digit is only in the tool's reply; a guess is right one time in ten. So a score above TRAINED needs
    # calls in more than (TRAINED - GUESS) / (1 - GUESS) of the episodes.
    assert calling[0] < 0.3 and calling[-1] > (TRAINED - GUESS) / (1 - GUESS), calling
    last = training[-1]
    assert "agent/failed/exited" not in last and "agent/failed/timeout" not in last  # every process completed
    # a call, then the answer with the tool's reply between: one segment per episode, the reply not trained on
    assert last["agent/segments"] == last["agent/episodes"]
    assert last["agent/tool_parse_errors"] < 0.1 * last["agent/episodes"]
