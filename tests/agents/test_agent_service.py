"""AgentService (protos/rlfabric/v1/agent.proto) on a real gRPC server on loopback: a host runs its agent per
RunEpisode, and the coordinator's ServiceRunner (agent.runner service) reads the outcome or the failure."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from rlfabric.agents.llm import LLM
from rlfabric.agents.outcome import AgentFailed, AgentOutcome
from rlfabric.agents.runners import InlineRunner, runner_of
from rlfabric.agents.service import AgentServicer
from rlfabric.core.config import ConfigError, load_config
from rlfabric.v1 import agent_pb2, agent_pb2_grpc

AGENT = '''
import asyncio

async def run(task, llm):
    kind = task["kind"]
    if kind == "raise":
        raise ValueError("no tools here")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "garbage":
        return None
    return {"answer": task["messages"][0]["content"], "reward": 0.5 if kind == "reward" else None,
            "metrics": {"key_chars": len(llm.api_key)}}
'''
LLM_HERE = LLM("http://127.0.0.1:9/v1", "rlf-ep-key", "policy")


async def on_a_host(tmp_path, scenario):
    (tmp_path / "agent.py").write_text(AGENT)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(InlineRunner(f"{tmp_path}/agent.py:run")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await scenario(f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


def test_a_host_answers_each_episode_with_its_agents_outcome_or_failure(tmp_path):
    task = {"messages": [{"role": "user", "content": "#### 4"}]}

    async def scenario(address):
        config = load_config(None, ["agent.runner=service", f"agent.address={address}", "agent.timeout_s=1"])
        runner = runner_of(config.agent)
        outcomes = [await runner.run({**task, "kind": kind}, LLM_HERE) for kind in ("answer", "reward")]
        failures = []
        for kind in ("raise", "garbage", "hang"):
            with pytest.raises(AgentFailed) as failure:
                await runner.run({**task, "kind": kind}, LLM_HERE)
            failures.append((failure.value.reason, str(failure.value)))
        return outcomes, failures

    outcomes, failures = asyncio.run(on_a_host(tmp_path, scenario))
    assert outcomes == [AgentOutcome(answer="#### 4", metrics={"key_chars": 10.0}),
                        AgentOutcome(reward=0.5, answer="#### 4", metrics={"key_chars": 10.0})]
    assert [reason for reason, _ in failures] == ["raised", "garbage", "timeout"]
    assert "ValueError: no tools here" in failures[0][1] and "timeout_s (1 s)" in failures[2][1]


def test_a_malformed_request_is_invalid_argument_and_an_absent_host_fails_the_episode(tmp_path):
    async def scenario(address):
        stub = agent_pb2_grpc.AgentServiceStub(grpc.aio.insecure_channel(address))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.RunEpisode(agent_pb2.AgentServiceRunEpisodeRequest(task_json=json.dumps([1]), base_url="x",
                                                                          api_key="k"))
        return error.value.code()

    assert asyncio.run(on_a_host(tmp_path, scenario)) == grpc.StatusCode.INVALID_ARGUMENT
    runner = runner_of(load_config(None, ["agent.runner=service", "agent.address=127.0.0.1:9"]).agent)
    with pytest.raises(AgentFailed, match="the agent host at 127.0.0.1:9: UNAVAILABLE") as failure:
        asyncio.run(runner.run({}, LLM_HERE))
    assert failure.value.reason == "host_error"
    with pytest.raises(ConfigError, match="set agent.address"):
        load_config(None, ["agent.runner=service"])
