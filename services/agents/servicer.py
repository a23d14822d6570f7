"""`rlfabric serve agent`: an AgentService host of the config's agent, so its episodes run in another pod or
process than the coordinator's (whose agent.runner service asks it: rlfabric.agents.service.ServiceRunner).

    rlfabric serve agent --config host.yaml --port 50070 --metrics-port 0
        host.yaml: agent.entrypoint: agent.py:run, agent.runner: subprocess (inline, command; not service)

Not a role of the mesh's (rlfabric.core.roles): no launcher starts it, the user runs it where the agent's code
and packages are. It serves as every service does (health, metrics, a port file, drain on SIGTERM), with
agent.auth_token_file's token, never the mesh's: agent code runs here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlfabric.agents.runners import runner_of
from rlfabric.agents.service import AgentServicer, read_agent_token
from rlfabric.core.config import ConfigError, RunConfig, read_auth_token
from rlfabric.core.server import ServerOptions, ServiceBinding, ServiceDefinition, serve
from rlfabric.v1 import agent_pb2_grpc

AGENT_HOST = "agent"  # `rlfabric serve agent`, beside the mesh's roles
SERVICE_NAME = "rlfabric.v1.AgentService"


class AgentHostEngine:
    """What the servicer runs episodes with: the config's runner (a warm host's process, say), closed at stop."""

    def __init__(self, config: RunConfig):
        settings = config.agent
        if settings.runner == "service":
            raise ConfigError(
                "agent.runner is service, but rlfabric serve agent runs the episodes itself: set "
                "agent.runner to inline, subprocess or command"
            )
        if not settings.runs_agents():
            raise ConfigError("rlfabric serve agent serves agent.entrypoint (or agent.command): set it")
        self.runner = runner_of(settings)

    async def start(self) -> None:
        pass  # a warm host starts with the first episode

    async def stop(self) -> None:
        await self.runner.close()


def build_service(config: RunConfig) -> ServiceDefinition:
    engine = AgentHostEngine(config)
    binding = ServiceBinding(
        AgentServicer(engine.runner), agent_pb2_grpc.add_AgentServiceServicer_to_server, SERVICE_NAME
    )
    return ServiceDefinition(role=AGENT_HOST, bindings=[binding], engine=engine)


def serve_agent_host(config: RunConfig, options: ServerOptions, port_file: str | Path | None = None) -> None:
    """Serves the config's agent until SIGTERM/SIGINT, with agent.auth_token_file's token."""
    options.auth_token = read_agent_token(config.agent, read_auth_token(config.server))
    asyncio.run(serve(build_service(config), options, port_file))
