"""CoordinatorService: run control for clients in any language; thin (proto <-> RunController), and
build_service, which `rlfabric serve coordinator` calls."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfabric.coordinator.run_controller import RunController
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = "rlfabric.v1.CoordinatorService"


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Explicit RPCs over the RunController."""

    def __init__(self, controller: RunController):
        self.controller = controller

    async def StartRun(self, request, context):
        run_id, start_step = await self.controller.start_run(list(request.overrides))
        return coordinator_pb2.CoordinatorServiceStartRunResponse(run_id=run_id, start_step=start_step)

    async def GetRunStatus(self, request, context):
        return self.controller.status()

    async def StreamMetrics(self, request, context):
        async for step, metrics, timestamp in self.controller.metrics_since(request.from_step):
            yield coordinator_pb2.CoordinatorServiceStreamMetricsResponse(step=step, metrics=metrics,
                                                                          timestamp=timestamp)

    async def PauseRun(self, request, context):
        self.controller.pause()
        return coordinator_pb2.CoordinatorServicePauseRunResponse()

    async def ResumeRun(self, request, context):
        self.controller.resume()
        return coordinator_pb2.CoordinatorServiceResumeRunResponse()

    async def StopRun(self, request, context):
        # A checkpoint unless the caller says skip_checkpoint (save_checkpoint is the older, explicit form).
        await self.controller.stop_run(request.save_checkpoint or not request.skip_checkpoint)
        return coordinator_pb2.CoordinatorServiceStopRunResponse()

    async def SaveCheckpoint(self, request, context):
        path, step = await self.controller.save_checkpoint()
        return coordinator_pb2.CoordinatorServiceSaveCheckpointResponse(path=str(path), step=step)

    async def RegisterRolloutReplica(self, request, context):
        self.controller.register_rollout_replica(request.address)
        return coordinator_pb2.CoordinatorServiceRegisterRolloutReplicaResponse()

    async def DeregisterRolloutReplica(self, request, context):
        self.controller.deregister_rollout_replica(request.address)
        return coordinator_pb2.CoordinatorServiceDeregisterRolloutReplicaResponse()


def build_service(config: RunConfig) -> ServiceDefinition:
    """The coordinator role: a RunController behind CoordinatorService."""
    numpy_without_huge_pages()
    registry = CollectorRegistry()
    controller = RunController(config, registry)
    binding = ServiceBinding(CoordinatorServicer(controller), coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                             SERVICE_NAME)
    return ServiceDefinition(role="coordinator", bindings=[binding], engine=controller, registry=registry)


def numpy_without_huge_pages() -> None:
    """Each step builds its batch in fresh numpy arrays (GBs at thousands of samples, freed at the step's end).
    numpy asks the kernel for transparent huge pages for them (madvise), and where THP defrag is "madvise" (the
    usual default) a fault then waits for memory compaction: 0.7 s for a 160 MB array on a busy host here
    against 0.1 s in plain pages. The coordinator gains nothing from huge pages for arrays it touches a few times."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # a numpy without the switch (before 2.0 it lived in numpy.core)
        return
    _set_madvise_hugepage(False)
