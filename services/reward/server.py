"""The reward role's service: `rlfabric serve reward --config C` builds it with build_service.

Serving itself (ports, health, metrics, graceful stop) is rlfabric.core.server's; this module only
wires the RewardEngine and its servicer into a ServiceDefinition. Nothing here imports torch.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.reward.engine import RewardEngine
from rlfabric.reward.servicer import RewardServicer
from rlfabric.v1 import reward_pb2_grpc

SERVICE_NAME = "rlfabric.v1.RewardService"


def build_service(config: RunConfig) -> ServiceDefinition:
    """The reward role: a RewardEngine for config.reward behind RewardService."""
    registry = CollectorRegistry()
    engine = RewardEngine(config.reward, registry, max_response_length=config.data.max_response_length)
    binding = ServiceBinding(
        RewardServicer(engine), reward_pb2_grpc.add_RewardServiceServicer_to_server, SERVICE_NAME
    )
    return ServiceDefinition(role="reward", bindings=[binding], engine=engine, registry=registry)
