"""Typed client of CoordinatorService (used by `rlfabric train` and `rlfabric status`)."""

from __future__ import annotations

from rlfabric.core.client import ServiceClient
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorClient(ServiceClient):
    """Run control: start a run, ask for its status."""

    stub_class = coordinator_pb2_grpc.CoordinatorServiceStub

    async def start_run(self, overrides: list[str] = ()) -> coordinator_pb2.StartRunResponse:
        return await self.call("StartRun", coordinator_pb2.StartRunRequest(overrides=list(overrides)))

    async def run_status(self, timeout_s: float | None = None) -> coordinator_pb2.GetRunStatusResponse:
        return await self.call("GetRunStatus", coordinator_pb2.GetRunStatusRequest(), timeout_s=timeout_s)
