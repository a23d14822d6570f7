"""Agent episodes as training data (issue 47, item 4): each (prompt, sample) is one run of the user's agent
through the gateway, its recorded calls joined into segments, one advantage per episode shared by its segments;
an agent that raises, hangs or returns garbage fails only its episode, and a run whose episodes all fail fails.

The runs are on the in-process mesh with the tiny model, their agents inline (plain openai SDK code)."""

from __future__ import annotations

import asyncio
import json

import torch

from rlfabric.coordinator.rollout_batch import build_episode_batch
from rlfabric.coordinator.step_metrics import StepTimer
from rlfabric.rollout.types import Finish, FinishedSample
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process, run_to_end
from tests.coordinator.test_loop import ROWS, ModelService, N, config, driver_over


def segment(prompt: int, sample: int, sampled: list[int], between: int = 0) -> FinishedSample:
    """A segment of episode (prompt, sample): `between` tokens the agent's messages added, then sampled ones."""
    tokens = [7] * between + sampled
    return FinishedSample(prompt, sample, tokens, [-0.5] * len(tokens), Finish.STOP, 0, prompt_ids=[1, 2],
                          loss_mask=[0] * between + [1] * len(sampled))


def test_an_episodes_segments_share_its_advantage_and_an_episode_without_calls_still_counts_in_its_group(tmp_path):
    # Episode (0, 0) recorded two segments (it rewrote its history), (0, 1) one; (1, 0) made no call,
    # (1, 1) one but its agent failed.
    segments = [segment(0, 0, [4, 5]), segment(1, 1, [4]), segment(0, 1, [6]), segment(0, 0, [5, 6], between=2)]
    batch = build_episode_batch(ROWS, segments, N, pad_token_id=0)
    assert batch.episode_ids.tolist() == [0, 0, 1, 3] and batch.group_ids.tolist() == [0, 0, 0, 1]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    batch.episode_scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch.episode_failed = torch.tensor([False, False, False, True])
    batch.scores = batch.episode_scores[batch.episode_ids]
    batch.score_failed = batch.episode_failed[batch.episode_ids]
    actor = ModelService("actor")
    driver = driver_over(config(), tmp_path, actor)
    asyncio.run(driver.steps.train_on(1, batch, StepTimer()))

    (update,) = actor.updates
    advantages, mask = update["advantages"], update["response_mask"]  # [4, T]
    first, rewritten, other, failed = (advantages[row][mask[row].bool()] for row in range(4))
    assert torch.allclose(first, first[0]) and torch.allclose(rewritten, first[0])  # one advantage, both segments
    assert first[0] > 0 and torch.allclose(other, -first[0])  # GRPO over the prompt's two episodes, not 3 rows
    assert failed.numel() == 0  # masked: the failed episode trains on nothing


AGENT = '''
import asyncio, itertools, json, os
from openai import AsyncOpenAI

EPISODES = itertools.count()


async def run(task, llm):
    with open(os.environ["AGENT_TASKS"], "a") as out:
        out.write(json.dumps(task) + "\\n")
    kind = os.environ["AGENT_KIND"] if os.environ["AGENT_KIND"] != "mixed" else \\
        ["good", "raise", "hang", "garbage"][next(EPISODES) % 4]
    if kind == "raise":
        raise RuntimeError("the agent's own bug")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "garbage":
        return ["not", "a", "reward"]
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        messages = list(task["messages"])
        first = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4)  # extends
        summary = [{"role": "user", "content": "summary: " + (second.choices[0].message.content or "")}]
        third = await client.chat.completions.create(model=llm.model, messages=summary, max_tokens=4)  # rewritten
    return {"answer": third.choices[0].message.content or "", "metrics": {"calls": 3}}
'''


def agent_run(tiny_model, tmp_path, monkeypatch, kind: str, *overrides: str):
    (tmp_path / "agent.py").write_text(AGENT)
    monkeypatch.setenv("AGENT_KIND", kind)
    monkeypatch.setenv("AGENT_TASKS", str(tmp_path / "tasks.jsonl"))
    config = fast_config(tiny_model, f"agent.entrypoint={tmp_path}/agent.py:run", "agent.timeout_s=2",
                         "trainer.total_steps=1", "trainer.export_final=false", "trainer.dump_rollouts=true",
                         *overrides)
    metrics, status = run_to_end(in_process, config, tmp_path / "run")
    tasks = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    return metrics, status, tasks


def test_agents_that_raise_hang_or_return_garbage_fail_their_episodes_and_the_run_goes_on(tiny_model, tmp_path,
                                                                                            monkeypatch):
    metrics, status, tasks = agent_run(tiny_model, tmp_path, monkeypatch, "mixed", "algorithm.max_failed_fraction=0.8")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    step = metrics[1]
    assert step["agent/episodes"] == 32 and step["agent/calls"] == 8 * 3  # 8 prompts x 4 samples; 8 good ones
    assert step["agent/failed/raised"] == step["agent/failed/timeout"] == step["agent/failed/garbage"] == 8
    assert step["agent/segments"] == 8 * 2  # the two calls that extend each other, then the rewritten one
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and not any(row["score_failed"] for row in rows)  # the failed episodes recorded no call
    assert len({(row["uid"], row["sample_index"]) for row in rows}) == 8  # two rows (segments) per good episode
    assert len(tasks) == 32 and all(set(task) == {"messages", "data_source", "ability", "uid", "extra_info"}
                                    for task in tasks)  # never reward_model's ground truth


def test_a_run_whose_agents_all_fail_ends_failed(tiny_model, tmp_path, monkeypatch):
    metrics, status, _ = agent_run(tiny_model, tmp_path, monkeypatch, "raise")
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and metrics == {}
    assert "32 of 32 samples failed (agent raised: 32)" in status.error and "the agent's own bug" in status.error
