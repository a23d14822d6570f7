"""Fixtures for the environment service tests: a real EnvironmentService on loopback, built the way
`rlfabric serve env` builds it, called through either client kind (EnvClient over gRPC, LocalEnvClient
on the same engine), so each test runs against both."""

from __future__ import annotations

import asyncio

import pytest

from rlfabric.core.config import EnvConfig, RunConfig
from rlfabric.env.client import EnvClient, LocalEnvClient
from rlfabric.env.servicer import build_service


class EnvServer:
    """A served env role, and its calls through one client kind ("grpc" or "local")."""

    def __init__(self, thread, kind: str):
        self.thread = thread
        self.kind = kind
        self.address = thread.address
        self.engine = thread.server.service.engine
        self.registry = thread.server.service.registry

    def call(self, method: str, *args, **kwargs):
        """<client>.<method>(*args): over gRPC on a fresh client and event loop, or in process on the
        server's own loop (where the engine lives)."""
        if self.kind == "local":
            return self.thread.run(getattr(LocalEnvClient(self.engine), method)(*args, **kwargs))

        async def over_grpc():
            async with EnvClient(self.address) as client:
                return await getattr(client, method)(*args, **kwargs)

        return asyncio.run(over_grpc())

    def reset(self, task):
        return self.call("reset", task)

    def step(self, session_id, action, **kwargs):
        return self.call("step", session_id, action, **kwargs)

    def close_session(self, session_id):
        return self.call("close_session", session_id)

    def status(self):
        return self.call("status")

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def server_factory(serve_in_thread, kind: str):
    def start(**fields) -> EnvServer:
        return EnvServer(serve_in_thread(build_service(RunConfig(env=EnvConfig(**fields)))), kind)

    return start


@pytest.fixture(params=["grpc", "local"])
def env_server(request, serve_in_thread):
    """Factory: env_server(**EnvConfig fields) -> EnvServer serving that config, for each client kind."""
    return server_factory(serve_in_thread, request.param)


@pytest.fixture
def grpc_env_server(serve_in_thread):
    """env_server for what only a gRPC caller has (its own deadline, a raw stub, two calls at once)."""
    return server_factory(serve_in_thread, "grpc")
