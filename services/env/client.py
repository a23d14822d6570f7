"""Typed clients of the environment service: domain objects in, domain objects out.

    async with EnvClient("127.0.0.1:50057") as env:
        session = await env.reset(Task("calculator", ground_truth="42"))
        result = await env.step(session.session_id, Action("", (ToolCall("calculator", '{"expression": "6*7"}'),)))
        await env.close_session(session.session_id)

Two implementations of one interface (EnvInterface: reset, step, close_session, status, close):
- EnvClient:      one service over gRPC (any language behind it: its answers are checked against the
                  contract, InvalidArgument when broken);
- LocalEnvClient: an EnvEngine in this process (tests, single-process runs).
Failures come back as rlfabric.core.errors exceptions (NotFound, DeadlineExceeded, ...); a call that
never reached the service (nothing listening at the address) is Unavailable, even past its deadline.
"""

from __future__ import annotations

from abc import abstractmethod

import grpc

from rlfabric.core import errors
from rlfabric.core.client import RoleInterface, ServiceClient
from rlfabric.env import wire
from rlfabric.env.engine import EnvEngine, EnvStatus
from rlfabric.env.items import Action, Session, StepResult, Task
from rlfabric.v1 import environment_pb2, environment_pb2_grpc


class EnvInterface(RoleInterface):
    """Sessions of environments a model acts in over several turns."""

    role = "env"

    @abstractmethod
    async def reset(self, task: Task, timeout_s: float | None = None) -> Session:
        """A new session on `task`: its id, first observation and tools."""

    @abstractmethod
    async def step(self, session_id: str, action: Action, timeout_s: float | None = None) -> StepResult:
        """Applies one model turn: the next observation, the reward, whether the episode is done."""

    @abstractmethod
    async def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        """Ends a session; NotFound when it is not open."""

    @abstractmethod
    async def status(self, timeout_s: float | None = None) -> EnvStatus:
        """Environments served, sessions open and counters."""


class EnvClient(ServiceClient, EnvInterface):
    """EnvInterface over gRPC, to one service."""

    stub_class = environment_pb2_grpc.EnvironmentServiceStub

    async def reset(self, task: Task, timeout_s: float | None = None) -> Session:
        response = await self.call("Reset", wire.reset_request(task), timeout_s)
        return wire.session_from_response(response, self._who())

    async def step(self, session_id: str, action: Action, timeout_s: float | None = None) -> StepResult:
        response = await self.call("Step", wire.step_request(session_id, action), timeout_s)
        return wire.step_from_response(response, self._who())

    async def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        await self.call("Close", environment_pb2.EnvironmentServiceCloseRequest(session_id=session_id), timeout_s)

    async def status(self, timeout_s: float | None = None) -> EnvStatus:
        response = await self.call("GetStatus", environment_pb2.EnvironmentServiceGetStatusRequest(), timeout_s)
        return EnvStatus(list(response.environments), response.sessions_open, response.sessions_started,
                         response.sessions_expired, response.steps)

    def _who(self) -> str:
        return f"the environment service at {self.address}"

    def domain_error(self, error: grpc.RpcError, method: str, timeout_s: float) -> errors.RlfabricError:
        """As every client's, except that a deadline passed before the channel ever connected (a refused
        or unroutable address: gRPC retries the connection until the deadline) is UNAVAILABLE, saying so,
        not DEADLINE_EXCEEDED: the environment was never reached, so it cannot have been slow."""
        state = self.channel.get_state(try_to_connect=False)
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED or state == grpc.ChannelConnectivity.READY:
            return super().domain_error(error, method, timeout_s)
        return errors.Unavailable(f"UNAVAILABLE: {self.role} at {self.address} ({method}): could not connect within "
                                  f"the {timeout_s:g} s deadline (channel {state.name})")


class LocalEnvClient(EnvInterface):
    """EnvInterface over an engine in this process (started and stopped by its owner). Requests go
    through their wire form and back, so the engine sees what it would be sent over gRPC."""

    def __init__(self, engine: EnvEngine):
        self.engine = engine

    async def reset(self, task: Task, timeout_s: float | None = None) -> Session:
        return await self.engine.reset(wire.task_from_request(wire.reset_request(task)))

    async def step(self, session_id: str, action: Action, timeout_s: float | None = None) -> StepResult:
        request = wire.step_request(session_id, action)
        return await self.engine.step(request.session_id, wire.action_from_request(request))

    async def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        await self.engine.close(session_id)

    async def status(self, timeout_s: float | None = None) -> EnvStatus:
        return self.engine.status()

    async def close(self) -> None:
        pass
