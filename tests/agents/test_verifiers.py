"""verifiers 0.4 environments (docs/verifiers.md): a task set becomes rows
(data.builtin_task verifiers), each episode is a verifiers episode played through the gateway
(examples/agents/verifiers/agent.py under the command runner, in a venv of its own: tests/agents/verifiers_venv.py),
and its reward is verifiers' own, sum(trace.reward) over the episode's traces.

The task set is examples/agents/verifiers/rlfabric_sums.py ("3+4=", the reply scored by a @vf.reward hook)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlfabric.core.config import ConfigError
from rlfabric.core.config.model import VerifiersConfig
from rlfabric.data.verifiers import write_verifiers
from rlfabric.v1 import coordinator_pb2
from tests.agents.verifiers_venv import verifiers_python
from tests.coordinator.meshes import fast_config, in_process, run_to_end

pytestmark = pytest.mark.slow

TASKSET_DIR = Path(__file__).resolve().parents[2] / "examples" / "agents" / "verifiers"
DIGITS_WEIGHT = 0.25  # rlfabric_sums.DIGITS_WEIGHT (the module imports verifiers, absent here)

# verifiers' own scoring of a reply to task `index`, apart from any episode: the task set's Task scores an offline
# Trace whose one assistant message is the reply (Task.score with no runtime), and trace.reward sums its rewards
# (score x weight). A reply of null stands for the task's own answer.
SCORE = """
import asyncio, json, sys
import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode
from verifiers.v1.types import AssistantMessage
from verifiers.v1.utils.loaders import load_taskset

tasks = list(load_taskset(vf.TasksetConfig(id=sys.argv[1])))
for line in sys.stdin:
    asked = json.loads(line)
    task = tasks[asked["index"]]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()),
                     nodes=[MessageNode(message=AssistantMessage(content=asked["reply"] or task.data.answer),
                                        sampled=True)])
    asyncio.run(task.score(trace))
    print(json.dumps({"reward": trace.reward, "answer": task.data.answer}))
"""


@pytest.fixture(scope="module")
def python() -> Path:
    return verifiers_python()


def settings(python: Path, **fields) -> VerifiersConfig:
    return VerifiersConfig(python=str(python), taskset="rlfabric_sums", path=[str(TASKSET_DIR)], **fields)


def verifiers_scores(python: Path, asked: list[dict], tmp_path: Path) -> list[dict]:
    script = tmp_path / "score.py"
    script.write_text(SCORE)
    done = subprocess.run(
        [str(python), str(script), "rlfabric_sums"],
        input="".join(json.dumps(a) + "\n" for a in asked),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TASKSET_DIR)},
        check=True,
        timeout=300,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_task_set_becomes_rows_without_its_answers(python, tmp_path):
    paths = write_verifiers(tmp_path, settings(python, size=8, val_size=4))
    train, val = (pq.read_table(paths[split]).to_pylist() for split in ("train", "val"))
    assert [row["extra_info"]["index"] for row in train + val] == list(range(12))
    for row in train:
        assert row["data_source"] == "verifiers/rlfabric_sums" and row["extra_info"]["split"] == "train"
        system, user = row["prompt"]
        assert system == {"role": "system", "content": "Answer with the number only."}
        assert user["role"] == "user" and user["content"].endswith("=")
        assert json.loads(row["reward_model"]["ground_truth"]) == {
            "taskset": "rlfabric_sums",
            "index": row["extra_info"]["index"],
        }
        assert "answer" not in json.dumps(row)
    # verifiers' scorer on each task's own answer (right: 1 + all digits: DIGITS_WEIGHT) and on wrong replies
    asked = [{"index": i, "reply": reply} for i in range(12) for reply in (None, "x", "x1")]
    scores = [scored["reward"] for scored in verifiers_scores(python, asked, tmp_path)]
    assert scores == [1 + DIGITS_WEIGHT, 0.0, DIGITS_WEIGHT / 2] * 12


def test_an_unknown_task_set_is_a_config_error_naming_the_key(python, tmp_path):
    with pytest.raises(ConfigError, match="data.verifiers"):
        write_verifiers(tmp_path, VerifiersConfig(python=str(python), taskset="no_such_taskset"))


def test_each_episode_runs_through_verifiers_and_scores_what_verifiers_scores(python, tiny_model, tmp_path):
    config = fast_config(
        tiny_model,
        "data.builtin_task=verifiers",
        f"data.verifiers.python={python}",
        "data.verifiers.taskset=rlfabric_sums",
        f"data.verifiers.path=[{TASKSET_DIR}]",
        "data.verifiers.size=8",
        "data.train_batch_size=2",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=128",
        "data.max_response_length=8",
        "trainer.total_steps=1",
        "trainer.export_final=false",
        "trainer.test_freq=0",
        "agent.runner=command",
        f"agent.command=[{python}, {TASKSET_DIR / 'agent.py'}]",
        "agent.timeout_s=240",
    )
    metrics, status = run_to_end(in_process, config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert metrics[1]["agent/episodes"] == 4 and metrics[1]["agent/calls"] >= 4
    assert not any(name.startswith("agent/failed") for name in metrics[1]), metrics[1]
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 4
    asked = [{"index": json.loads(s["ground_truth"])["index"], "reply": s["response"]} for s in samples]
    scored = verifiers_scores(python, asked, tmp_path)
    print("replies", [(a["reply"], s["answer"], s["reward"]) for a, s in zip(asked, scored, strict=True)])
    assert [sample["score"] for sample in samples] == [s["reward"] for s in scored]
    assert any(sample["score"] > 0 for sample in samples), "noise from the tiny model holds some digits"
