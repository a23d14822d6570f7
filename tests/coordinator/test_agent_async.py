"""Agent episodes in async mode (issue 47, item 5 and its acceptance row "async k=1 with weights moving
mid-episode"): an episode whose calls straddle a weight sync records each call's tokens with the version that
sampled them, its segments span both versions, staleness is judged by its oldest token, and no agent call
fails; a call made while its replica is paused is held at the replica's gate and answered after Resume.

On the in-process mesh with the tiny model; the agent is inline (this module's `agent`, plain openai SDK code)
and made to wait between its calls on events, never sleeps."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import openai
from openai import AsyncOpenAI

from rlfabric.coordinator.setup import load_datasets, open_run
from rlfabric.core.host import load_tokenizer
from rlfabric.data.dataset import DataCursor
from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config
from tests.coordinator.test_agent_gateway_run import StepMetrics
from tests.waiting import wait_until_async


@dataclass
class Agents:
    """What this module's agent reads (whose second call waits for step 1's weight sync) and what it saw."""

    straight: set[str]  # step 1's rows: both calls at once
    across_sync: set[str]  # step 2's rows: the second call once step 1's weights are synced
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    errors: list[str] = field(default_factory=list)  # every error an agent's call got


AGENTS: Agents | None = None


async def agent(task, llm):
    """Two calls, the second extending the first (one segment); a row of no step this run trains waits to be
    cancelled with the run's end."""
    agents, uid = AGENTS, task["uid"]
    if uid not in agents.straight | agents.across_sync:
        await asyncio.Event().wait()
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        messages = list(task["messages"])
        try:
            first = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
            if uid in agents.across_sync:
                await agents.synced.wait()
            messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            second = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
        except openai.APIError as error:
            agents.errors.append(f"{type(error).__name__}: {error}")
            raise
    return float(len(second.choices[0].message.content or "") % 2)


def test_async_k1_episodes_straddling_a_weight_sync_record_both_versions_and_are_judged_by_the_oldest(
        tiny_model, tmp_path):
    global AGENTS
    config = fast_config(tiny_model, f"agent.entrypoint={__name__}:agent", "trainer.mode=async",
                         "trainer.max_staleness=1", "trainer.total_steps=2", "trainer.test_freq=0",
                         "trainer.export_final=false", "trainer.dump_rollouts=true",
                         "trainer.dump_rollout_tokens=true")
    # The rows of steps 1 and 2, as the run draws them: RolloutStream's batches from the start.
    train, _ = load_datasets(config, tmp_path / "data", load_tokenizer(str(tiny_model)))
    batches = train.batches(config.data.train_batch_size, config.data.seed, DataCursor())
    first, second = ({row.uid for row in next(batches)} for _ in range(2))
    assert len(first) == len(second) == 8 and not first & second

    async def scenario():
        global AGENTS
        AGENTS = Agents(first, second)
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            client = mesh.coordinator
            await client.start_run()
            metrics = {}
            async for update in client.stream_metrics(from_step=1):
                metrics[update.step] = dict(update.metrics)
                if update.step == 1:  # trained and synced: step 2's episodes make their second calls
                    AGENTS.synced.set()
            return metrics, await client.run_status()

    try:
        metrics, status = asyncio.run(scenario())
        errors = AGENTS.errors
    finally:
        AGENTS = None
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert errors == []  # no agent call failed, the one after the sync included
    step = metrics[2]
    assert step["agent/episodes"] >= 32 and not any(name.startswith("agent/rejected") for name in step)
    assert not any(name.startswith("agent/failed") for name in step)

    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and {row["uid"] for row in rows} == second  # one segment per episode of step 2's rows
    policy = step["rollout/weight_version"] - 1  # the version step 2 trains: the one before its own sync
    for row in rows:
        (first_version, start), (second_version, switch) = row["version_spans"]
        # Call 1 and the tokens the agent added after it from step 1's weights, call 2 from step 2's.
        assert (first_version, start, second_version) == (policy - 1, 0, policy)
        assert row["weight_version"] == policy - 1 and 0 < switch < len(row["response_ids"])
    # Each segment is one version behind by its oldest token, though most of its tokens are not.
    assert step["rollout/staleness/max"] == step["rollout/staleness/mean"] == 1.0
    assert 0 < step["rollout/staleness/token_mean"] < 1
    assert step["rollout/partial_fraction"] == 1.0
    assert metrics[1]["rollout/staleness/max"] == 0.0


def test_a_call_made_while_its_replica_is_paused_is_held_and_answered_after_resume(tiny_model, tmp_path):
    config = fast_config(tiny_model, "agent.gateway.enable=true", "trainer.total_steps=1", "trainer.test_freq=0")

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            async with open_run(mesh.config, StepMetrics(), connect=mesh.connect) as driver:
                gateway, (replica,) = driver.gateway, driver.peers.rollout.replicas
                episode = gateway.episodes.open(seed=3)
                async with AsyncOpenAI(base_url=gateway.base_url, api_key=episode.key, max_retries=0) as client:
                    await replica.client.pause(abort=False)
                    call = asyncio.create_task(client.chat.completions.create(
                        model=gateway.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]))
                    held = await wait_until_async(lambda: _held(replica.client), 30, "the call held at the gate")
                    waiting = not call.done() and gateway.calls.inflight == 1
                    await replica.client.resume()
                    reply = await call
                record = gateway.episodes.close(episode.key)
        return held, waiting, reply, record

    held, waiting, reply, record = asyncio.run(scenario())
    assert held.paused and held.queue_depth == 1 and waiting
    (call,) = record.calls
    assert reply.choices[0].message.content == call.text and reply.usage.completion_tokens == len(call.token_ids) > 0


async def _held(rollout):
    """The replica's status once it holds a request while paused, else None."""
    status = await rollout.status()
    return status if status.paused and status.queue_depth else None
