"""Client of CoordinatorService (used by `rlfabric train`, `rlfabric status` and `rlfabric stop`).

    async with CoordinatorClient("127.0.0.1:50050") as coordinator:
        started = await coordinator.start_run(["trainer.total_steps=10"])
        async for update in coordinator.stream_metrics(from_step=1):
            print(update.step, update.metrics["critic/score/mean"])

CoordinatorInterface is run control as a caller sees it; CoordinatorClient implements it over gRPC,
LocalCoordinatorClient over a RunController in this process (`rlfabric train --in-process`). Answers
are the service's messages (rlfabric.v1.coordinator_pb2); failed calls raise the domain error of their
status code (FailedPrecondition for a second run, InvalidArgument for a bad override, ...).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from rlfabric.core.client import RoleInterface, ServiceClient
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

if TYPE_CHECKING:
    from rlfabric.coordinator.servicer import RunController


class CoordinatorInterface(RoleInterface):
    """Run control: start, pause, resume and stop a run, checkpoint it, follow it."""

    role = "coordinator"

    @abstractmethod
    async def start_run(self, overrides: Sequence[str] = (),
                        timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceStartRunResponse:
        """Starts a run of the service's config with `overrides` ("key=value"); returns its id and the
        step it starts from (above 0 when it resumes)."""

    @abstractmethod
    async def run_status(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        """State, step, phase and error of the current (or last) run."""

    @abstractmethod
    def stream_metrics(self, from_step: int = 0, timeout_s: float | None = None,
                       ) -> AsyncIterator[coordinator_pb2.CoordinatorServiceStreamMetricsResponse]:
        """The metrics of every finished step from `from_step` on (older steps replayed from the run's
        history), until the run ends or the deadline passes."""

    @abstractmethod
    async def pause_run(self, timeout_s: float | None = None) -> None:
        """Holds the run at the next step boundary."""

    @abstractmethod
    async def resume_run(self, timeout_s: float | None = None) -> None:
        """Lets a paused run go on."""

    @abstractmethod
    async def stop_run(self, skip_checkpoint: bool = False, timeout_s: float | None = None) -> None:
        """Ends the run at the next step boundary, after a checkpoint and the final-model export unless
        skip_checkpoint; returns once the run has ended."""

    @abstractmethod
    async def save_checkpoint(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceSaveCheckpointResponse:
        """A checkpoint at the next step boundary; returns its path and step once it is written."""

    @abstractmethod
    async def register_rollout_replica(self, address: str, timeout_s: float | None = None) -> None:
        """The rollout replica at `address` ("host:port") joins: it gets the weights and requests from the
        run's next weight sync on."""

    @abstractmethod
    async def deregister_rollout_replica(self, address: str, timeout_s: float | None = None) -> None:
        """The rollout replica at `address` leaves: no new request or weights from the run's next weight sync on."""


class CoordinatorClient(ServiceClient, CoordinatorInterface):
    """CoordinatorInterface over gRPC."""

    stub_class = coordinator_pb2_grpc.CoordinatorServiceStub

    async def start_run(self, overrides: Sequence[str] = (),
                        timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceStartRunResponse:
        request = coordinator_pb2.CoordinatorServiceStartRunRequest(overrides=list(overrides))
        return await self.call("StartRun", request, timeout_s)

    async def run_status(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        return await self.call("GetRunStatus", coordinator_pb2.CoordinatorServiceGetRunStatusRequest(), timeout_s)

    async def stream_metrics(self, from_step: int = 0, timeout_s: float | None = None,
                             ) -> AsyncIterator[coordinator_pb2.CoordinatorServiceStreamMetricsResponse]:
        request = coordinator_pb2.CoordinatorServiceStreamMetricsRequest(from_step=from_step)
        async for update in self.stream("StreamMetrics", request, timeout_s):
            yield update

    async def pause_run(self, timeout_s: float | None = None) -> None:
        await self.call("PauseRun", coordinator_pb2.CoordinatorServicePauseRunRequest(), timeout_s)

    async def resume_run(self, timeout_s: float | None = None) -> None:
        await self.call("ResumeRun", coordinator_pb2.CoordinatorServiceResumeRunRequest(), timeout_s)

    async def stop_run(self, skip_checkpoint: bool = False, timeout_s: float | None = None) -> None:
        request = coordinator_pb2.CoordinatorServiceStopRunRequest(skip_checkpoint=skip_checkpoint)
        await self.call("StopRun", request, timeout_s)

    async def save_checkpoint(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceSaveCheckpointResponse:
        return await self.call("SaveCheckpoint", coordinator_pb2.CoordinatorServiceSaveCheckpointRequest(), timeout_s)

    async def register_rollout_replica(self, address: str, timeout_s: float | None = None) -> None:
        request = coordinator_pb2.CoordinatorServiceRegisterRolloutReplicaRequest(address=address)
        await self.call("RegisterRolloutReplica", request, timeout_s)

    async def deregister_rollout_replica(self, address: str, timeout_s: float | None = None) -> None:
        request = coordinator_pb2.CoordinatorServiceDeregisterRolloutReplicaRequest(address=address)
        await self.call("DeregisterRolloutReplica", request, timeout_s)


class LocalCoordinatorClient(CoordinatorInterface):
    """CoordinatorInterface over a RunController in this process; the same answers as CoordinatorServicer."""

    def __init__(self, controller: RunController):
        self.controller = controller

    async def start_run(self, overrides: Sequence[str] = (),
                        timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceStartRunResponse:
        run_id, start_step = await self.controller.start_run(list(overrides))
        return coordinator_pb2.CoordinatorServiceStartRunResponse(run_id=run_id, start_step=start_step)

    async def run_status(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        return self.controller.status()

    async def stream_metrics(self, from_step: int = 0, timeout_s: float | None = None,
                             ) -> AsyncIterator[coordinator_pb2.CoordinatorServiceStreamMetricsResponse]:
        async for step, metrics, timestamp in self.controller.metrics_since(from_step):
            yield coordinator_pb2.CoordinatorServiceStreamMetricsResponse(step=step, metrics=metrics,
                                                                          timestamp=timestamp)

    async def pause_run(self, timeout_s: float | None = None) -> None:
        self.controller.pause()

    async def resume_run(self, timeout_s: float | None = None) -> None:
        self.controller.resume()

    async def stop_run(self, skip_checkpoint: bool = False, timeout_s: float | None = None) -> None:
        await self.controller.stop_run(save_checkpoint=not skip_checkpoint)

    async def save_checkpoint(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceSaveCheckpointResponse:
        path, step = await self.controller.save_checkpoint()
        return coordinator_pb2.CoordinatorServiceSaveCheckpointResponse(path=str(path), step=step)

    async def register_rollout_replica(self, address: str, timeout_s: float | None = None) -> None:
        self.controller.register_rollout_replica(address)

    async def deregister_rollout_replica(self, address: str, timeout_s: float | None = None) -> None:
        self.controller.deregister_rollout_replica(address)

    async def close(self) -> None:
        """Nothing to release: the controller belongs to whoever made it."""
