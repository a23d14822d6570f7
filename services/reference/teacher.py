"""build_service for the teacher role (on-policy distillation, algorithm.distill), which rlfabric.serve calls:
the ReferenceService (log-probs) over a TrainerEngine("teacher") holding teacher.model_path. It receives no
weights: a weight-sync call is refused (FAILED_PRECONDITION, the engine's)."""

from __future__ import annotations

from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceDefinition
from rlfabric.reference.servicer import ReferenceServicer
from rlfabric.trainer.servicer import build_trainer_service
from rlfabric.v1 import reference_pb2_grpc


def build_service(config: RunConfig) -> ServiceDefinition:
    """The teacher role: ReferenceService over a TrainerEngine("teacher")."""
    return build_trainer_service("teacher", config, ReferenceServicer,
                                 reference_pb2_grpc.add_ReferenceServiceServicer_to_server, "rlfabric.v1.ReferenceService")
