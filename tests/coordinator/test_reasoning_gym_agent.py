"""An agent (agent.entrypoint) on reasoning-gym rows: it gets the question and the row's public fields, never the
ground truth, and the answer it returns is scored by the reward service with reasoning-gym's own scorer.

The agent (plain openai SDK code, inline) calls the model once, as agents do, then works chain_sum's sum out of
the question itself and returns it in <answer> tags: every episode then scores 1.0, which only the regenerated
entry's score_answer can give it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")  # the extra rlfabric[reasoning-gym]; in the dev install

from rlfabric.v1 import coordinator_pb2  # noqa: E402
from tests.coordinator.meshes import fast_config, in_process, run_to_end  # noqa: E402

AGENT = """
import json
import os
import re

from openai import AsyncOpenAI


async def run(task, llm):
    with open(os.environ["AGENT_TASKS"], "a") as tasks:
        tasks.write(json.dumps(task) + "\\n")
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(model=llm.model, messages=task["messages"], max_tokens=4)
    # "State the final answer to the following arithmetic problem: 4 - 1 - 7 ="
    expression = task["messages"][-1]["content"].rsplit(":", 1)[1]
    total, sign = 0, 1
    for token in re.findall(r"[-+]|[0-9]+", expression):
        if token in "+-":
            sign = -1 if token == "-" else 1
        else:
            total += sign * int(token)
    return f"<answer>{total}</answer>"
"""


def test_an_agent_sees_no_ground_truth_and_its_answer_is_scored_by_reasoning_gym(
    tiny_model, tmp_path, monkeypatch
):
    (tmp_path / "agent.py").write_text(AGENT)
    monkeypatch.setenv("AGENT_TASKS", str(tmp_path / "tasks.jsonl"))
    config = fast_config(
        tiny_model,
        f"agent.entrypoint={tmp_path}/agent.py:run",
        "trainer.total_steps=1",
        "trainer.export_final=false",
        "trainer.test_freq=0",
        "data.builtin_task=reasoning_gym",
        "data.reasoning_gym.datasets={chain_sum: {config: {max_terms: 3, max_digits: 2}}}",
        "data.reasoning_gym.size=16",
        "data.reasoning_gym.val_size=0",
        "data.reasoning_gym.system_prompt=''",
        "data.max_prompt_length=128",
    )
    metrics, status = run_to_end(in_process, config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert metrics[1]["agent/episodes"] == 32 and metrics[1]["critic/score/mean"] == 1.0

    tasks = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    truths = {row["reward_model"]["ground_truth"] for row in _rows(tmp_path / "run")}
    assert len(tasks) == 32 and len(truths) == 16
    for task in tasks:
        assert set(task) == {"messages", "data_source", "ability", "uid", "extra_info"}
        assert task["data_source"] == "reasoning_gym/chain_sum" and set(task["extra_info"]) == {
            "split",
            "index",
            "dataset",
        }
        assert not any(truth in json.dumps(task) for truth in truths)


def _rows(run_dir):
    import pyarrow.parquet as pq

    return pq.read_table(run_dir / "data" / "reasoning_gym" / "train.parquet").to_pylist()
