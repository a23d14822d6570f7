"""Client of CoordinatorService (used by `rlfabric train`, `rlfabric status` and `rlfabric stop`).

    async with CoordinatorClient("127.0.0.1:50050") as coordinator:
        started = await coordinator.start_run(["trainer.total_steps=10"])
        async for update in coordinator.stream_metrics(from_step=1):
            print(update.step, update.metrics["critic/score/mean"])

CoordinatorInterface is run control as a caller sees it; CoordinatorClient implements it over gRPC.
Answers are the service's messages (rlfabric.v1.coordinator_pb2); failed calls raise the domain error
of their status code (FailedPrecondition for a second run, InvalidArgument for a bad override, ...).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence

from rlfabric.core.client import ServiceClient
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorInterface(ABC):
    """Run control: start, pause, resume and stop a run, checkpoint it, follow it."""

    role = "coordinator"

    @abstractmethod
    async def start_run(self, overrides: Sequence[str] = (),
                        timeout_s: float | None = None) -> coordinator_pb2.StartRunResponse:
        """Starts a run of the service's config with `overrides` ("key=value"); returns its id and the
        step it starts from (above 0 when it resumes)."""

    @abstractmethod
    async def run_status(self, timeout_s: float | None = None) -> coordinator_pb2.GetRunStatusResponse:
        """State, step, phase and error of the current (or last) run."""

    @abstractmethod
    def stream_metrics(self, from_step: int = 0,
                       timeout_s: float | None = None) -> AsyncIterator[coordinator_pb2.StreamMetricsResponse]:
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
    async def close(self) -> None:
        """Releases the connection (or whatever the implementation holds)."""


class CoordinatorClient(ServiceClient, CoordinatorInterface):
    """CoordinatorInterface over gRPC."""

    stub_class = coordinator_pb2_grpc.CoordinatorServiceStub

    async def start_run(self, overrides: Sequence[str] = (),
                        timeout_s: float | None = None) -> coordinator_pb2.StartRunResponse:
        return await self.call("StartRun", coordinator_pb2.StartRunRequest(overrides=list(overrides)), timeout_s)

    async def run_status(self, timeout_s: float | None = None) -> coordinator_pb2.GetRunStatusResponse:
        return await self.call("GetRunStatus", coordinator_pb2.GetRunStatusRequest(), timeout_s)

    async def stream_metrics(self, from_step: int = 0,
                             timeout_s: float | None = None) -> AsyncIterator[coordinator_pb2.StreamMetricsResponse]:
        request = coordinator_pb2.StreamMetricsRequest(from_step=from_step)
        async for update in self.stream("StreamMetrics", request, timeout_s):
            yield update

    async def pause_run(self, timeout_s: float | None = None) -> None:
        await self.call("PauseRun", coordinator_pb2.PauseRunRequest(), timeout_s)

    async def resume_run(self, timeout_s: float | None = None) -> None:
        await self.call("ResumeRun", coordinator_pb2.ResumeRunRequest(), timeout_s)

    async def stop_run(self, skip_checkpoint: bool = False, timeout_s: float | None = None) -> None:
        await self.call("StopRun", coordinator_pb2.StopRunRequest(skip_checkpoint=skip_checkpoint), timeout_s)

    async def save_checkpoint(
            self, timeout_s: float | None = None) -> coordinator_pb2.CoordinatorServiceSaveCheckpointResponse:
        return await self.call("SaveCheckpoint", coordinator_pb2.CoordinatorServiceSaveCheckpointRequest(), timeout_s)
