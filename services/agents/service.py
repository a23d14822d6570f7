"""AgentService over gRPC (protos/rlfabric/v1/agent.proto): a host of agent code, and the runner that asks one.

    rlfabric serve agent --config host.yaml --port 50070   # agent.runner subprocess (or inline, command) there
    runner = ServiceRunner("127.0.0.1:50070")               # the mesh's agent.runner service, agent.address
    outcome = await runner.run(task, llm)

A host may be written in any language: it implements RunEpisode. The Python servicer here hosts any runner
(an entrypoint inline, or a program per episode); the coordinator's ServiceRunner turns the response back into
an AgentOutcome, or an AgentFailed the step masks and counts.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc

from rlfabric.agents.llm import LLM, AgentRunner
from rlfabric.agents.outcome import TIMEOUT, AgentFailed, AgentOutcome, parse_outcome
from rlfabric.core.config import ConfigError, read_named_file
from rlfabric.core.config.agent import AgentConfig
from rlfabric.v1 import agent_pb2, agent_pb2_grpc

HOST_ERROR = "host_error"  # the AgentFailed reason of an RPC that failed (the host is down, refused the request)


def read_agent_token(settings: AgentConfig, mesh_token: str = "") -> str:
    """agent.auth_token_file's token ("" when none is configured); ConfigError when the file is empty or holds
    the mesh's token, which must not reach a host of agent code."""
    if not settings.auth_token_file:
        return ""
    token = read_named_file("agent.auth_token_file", settings.auth_token_file).decode().strip()
    if not token:
        raise ConfigError(f"agent.auth_token_file: {settings.auth_token_file} is empty")
    if token == mesh_token:
        raise ConfigError("agent.auth_token_file holds the mesh's token (server.auth_token_file): an agent host must "
                          "get a token of its own, which authorises nothing else")
    return token


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Runs each RunEpisode's episode with `runner`; an agent's failure is the response's, not the RPC's."""

    def __init__(self, runner: AgentRunner):
        self.runner = runner

    async def RunEpisode(self, request: agent_pb2.AgentServiceRunEpisodeRequest,
                         context: grpc.aio.ServicerContext) -> agent_pb2.AgentServiceRunEpisodeResponse:
        try:
            task = json.loads(request.task_json)
        except ValueError:
            task = None
        if not isinstance(task, dict) or not request.base_url or not request.api_key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "RunEpisode needs task_json (a JSON object), base_url and api_key")
        llm = LLM(request.base_url, request.api_key, request.model)
        try:
            outcome = await asyncio.wait_for(self.runner.run(task, llm), request.timeout_s or None)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the episode ran past its timeout_s ({request.timeout_s:g} s)")
        except AgentFailed as failure:
            return agent_pb2.AgentServiceRunEpisodeResponse(
                failure=agent_pb2.AgentFailure(reason=failure.reason, message=str(failure)))
        return agent_pb2.AgentServiceRunEpisodeResponse(reward=outcome.reward, answer=outcome.answer,
                                                        metrics=outcome.metrics)


class ServiceRunner:
    """agent.runner service: each episode is a RunEpisode on the agent host at `address`."""

    def __init__(self, address: str, timeout_s: float = 0.0, token: str = ""):
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: agent_pb2_grpc.AgentServiceStub | None = None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None

    async def run(self, task: dict[str, Any], llm: LLM) -> AgentOutcome:
        if self._stub is None:  # made on the loop that runs the episodes
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        request = agent_pb2.AgentServiceRunEpisodeRequest(task_json=json.dumps(task), base_url=llm.base_url,
                                                          api_key=llm.api_key, model=llm.model,
                                                          timeout_s=self.timeout_s)
        try:
            response = await self._stub.RunEpisode(request, metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            reason = TIMEOUT if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else HOST_ERROR
            raise AgentFailed(reason, f"the agent host at {self.address}: {error.code().name}: {error.details()}") \
                from None
        if response.HasField("failure"):
            raise AgentFailed(response.failure.reason or HOST_ERROR, response.failure.message)
        value: dict[str, Any] = {"metrics": dict(response.metrics)}
        if response.HasField("reward"):
            value["reward"] = response.reward
        if response.HasField("answer"):
            value["answer"] = response.answer
        return parse_outcome(value)
