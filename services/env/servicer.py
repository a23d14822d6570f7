"""EnvironmentService: proto -> domain objects -> await the engine -> proto (no session logic here),
and build_service, which `rlfabric serve env` calls. Nothing here imports torch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.env import wire
from rlfabric.env.engine import EnvEngine
from rlfabric.v1 import environment_pb2, environment_pb2_grpc

SERVICE_NAME = "rlfabric.v1.EnvironmentService"


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Thin gRPC face of an EnvEngine; domain errors become status codes in the ErrorInterceptor."""

    def __init__(self, engine: EnvEngine):
        self.engine = engine

    async def Reset(self, request: environment_pb2.EnvironmentServiceResetRequest,
                    context) -> environment_pb2.EnvironmentServiceResetResponse:
        return wire.reset_response(await self.engine.reset(wire.task_from_request(request)))

    async def Step(self, request: environment_pb2.EnvironmentServiceStepRequest,
                   context) -> environment_pb2.EnvironmentServiceStepResponse:
        result = await self.engine.step(request.session_id, wire.action_from_request(request))
        return wire.step_response(result)

    async def Close(self, request: environment_pb2.EnvironmentServiceCloseRequest,
                    context) -> environment_pb2.EnvironmentServiceCloseResponse:
        await self.engine.close(request.session_id)
        return environment_pb2.EnvironmentServiceCloseResponse()

    async def GetStatus(self, request, context) -> environment_pb2.EnvironmentServiceGetStatusResponse:
        status = self.engine.status()
        return environment_pb2.EnvironmentServiceGetStatusResponse(
            environments=status.environments, sessions_open=status.sessions_open,
            sessions_started=status.sessions_started, sessions_expired=status.sessions_expired, steps=status.steps)


def build_service(config: RunConfig) -> ServiceDefinition:
    """The env role: an EnvEngine for config.env behind EnvironmentService."""
    registry = CollectorRegistry()
    engine = EnvEngine(config.env, registry)
    binding = ServiceBinding(EnvironmentServicer(engine), environment_pb2_grpc.add_EnvironmentServiceServicer_to_server,
                             SERVICE_NAME)
    return ServiceDefinition(role="env", bindings=[binding], engine=engine, registry=registry)
