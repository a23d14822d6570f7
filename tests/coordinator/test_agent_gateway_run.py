"""A run with agent.gateway.enable starts the agent gateway itself, over the run's rollout router, reports its
agent/* metrics with the step's (and its call latencies to the coordinator's Prometheus registry), and stops it
when the run's connections close: no extra command (issue 47, item 1). A tool-call format the model's chat
template does not write is refused before the run starts (item 3)."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from rlfabric.coordinator.driver import NoHooks
from rlfabric.coordinator.setup import open_run
from rlfabric.core.config import run_dir_of
from rlfabric.core.errors import InvalidArgument
from rlfabric.launch.inprocess import InProcessMesh
from tests.coordinator.meshes import fast_config
from tests.gateway.templates import QWEN3_XML


class StepMetrics(NoHooks):
    def __init__(self):
        self.steps: dict[int, dict[str, float]] = {}

    def on_metrics(self, step, metrics, trace_id):
        self.steps[step] = metrics


def test_a_run_with_the_gateway_on_serves_agents_through_its_rollout_router(tiny_model, tmp_path):
    config = fast_config(tiny_model, "agent.gateway.enable=true", "trainer.total_steps=1", "trainer.test_freq=0",
                         "trainer.export_final=false")
    hooks = StepMetrics()
    registry = CollectorRegistry()

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            async with open_run(mesh.config, hooks, connect=mesh.connect, registry=registry) as driver:
                gateway = driver.gateway
                episode = gateway.episodes.open()
                client = AsyncOpenAI(base_url=gateway.base_url, api_key=episode.key, max_retries=0)
                reply = await client.chat.completions.create(model=gateway.model, max_tokens=4,
                                                             messages=[{"role": "user", "content": "hi"}])
                record = gateway.episodes.close(episode.key)
                url = gateway.base_url
                await driver.prepare(run_dir_of(mesh.config) / "initial_weights")
                await driver.run()
            try:
                await httpx.AsyncClient().get(url.removesuffix("/v1") + "/health", timeout=5)
                stopped = False
            except httpx.ConnectError:
                stopped = True
            return reply, record, stopped

    reply, record, stopped = asyncio.run(scenario())
    (call,) = record.calls
    assert reply.choices[0].message.content == call.text and len(call.token_ids) == reply.usage.completion_tokens
    assert hooks.steps[1]["agent/calls"] == 1.0 and hooks.steps[1]["agent/call_seconds/mean"] > 0
    assert registry.get_sample_value("rlfabric_agent_call_latency_seconds_count") == 1.0
    assert registry.get_sample_value("rlfabric_agent_call_latency_seconds_sum") == call.seconds > 0
    assert stopped


def test_a_tool_call_format_the_template_does_not_write_is_refused_before_the_run_starts(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    (model / "chat_template.jinja").write_text(QWEN3_XML)  # Qwen3-Coder's calls; the default format is hermes
    config = fast_config(model, "agent.gateway.enable=true", "trainer.total_steps=1", "trainer.test_freq=0")
    hooks = StepMetrics()

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            async with open_run(mesh.config, hooks, connect=mesh.connect):
                pass

    with pytest.raises(InvalidArgument) as refused:
        asyncio.run(scenario())
    assert str(refused.value).startswith("agent.gateway.tool_call_format=hermes does not read back the tool call")
    assert str(refused.value).endswith("set agent.gateway.tool_call_format=qwen3_xml")
    assert hooks.steps == {}
