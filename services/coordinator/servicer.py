"""CoordinatorService: run control for clients in any language (thin: proto <-> controller)."""

from __future__ import annotations

from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Answers run-status queries; the PPO loop itself lives in the coordinator engine."""

    def __init__(self, controller):
        self.controller = controller

    async def GetRunStatus(self, request, context):
        return self.controller.status()


class RunController:
    """Holds the state of the current run. Until a run is started it reports none."""

    def __init__(self):
        self.run_id = ""
        self.state = coordinator_pb2.RUN_STATE_UNSPECIFIED

    def status(self) -> coordinator_pb2.GetRunStatusResponse:
        return coordinator_pb2.GetRunStatusResponse(run_id=self.run_id, state=self.state)

    async def start(self) -> None:
        """Nothing to load: the coordinator holds no model."""

    async def stop(self) -> None:
        """Nothing to release."""
