"""Typed client of CoordinatorService (used by `rlfabric train` and `rlfabric status`)."""

from __future__ import annotations

from rlfabric.core.client import ServiceClient
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorClient(ServiceClient):
    """Run control: start, pause, resume and stop a run, checkpoint it, ask for its status."""

    stub_class = coordinator_pb2_grpc.CoordinatorServiceStub

    async def start_run(self, overrides: list[str] = ()) -> coordinator_pb2.StartRunResponse:
        return await self.call("StartRun", coordinator_pb2.StartRunRequest(overrides=list(overrides)))

    async def run_status(self, timeout_s: float | None = None) -> coordinator_pb2.GetRunStatusResponse:
        return await self.call("GetRunStatus", coordinator_pb2.GetRunStatusRequest(), timeout_s=timeout_s)

    async def pause_run(self) -> None:
        await self.call("PauseRun", coordinator_pb2.PauseRunRequest())

    async def resume_run(self) -> None:
        await self.call("ResumeRun", coordinator_pb2.ResumeRunRequest())

    async def stop_run(self, skip_checkpoint: bool = False, timeout_s: float | None = None) -> None:
        """Ends the run at the next step boundary, after a checkpoint and the final-model export unless
        skip_checkpoint; returns once the run has ended."""
        await self.call("StopRun", coordinator_pb2.StopRunRequest(skip_checkpoint=skip_checkpoint), timeout_s=timeout_s)

    async def save_checkpoint(self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceSaveCheckpointResponse:
        return await self.call("SaveCheckpoint", coordinator_pb2.CoordinatorServiceSaveCheckpointRequest(),
                               timeout_s=timeout_s)
