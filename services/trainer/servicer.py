"""What the three model roles' services share: decoding a log-probs request, and building a role's service
over a TrainerEngine (rlfabric.actor.servicer, rlfabric.reference.servicer and rlfabric.critic.servicer
each give it their own servicer class)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfabric.core import codec
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.trainer.client import FORWARD_BATCH, wire_temperature
from rlfabric.trainer.engine import TrainerEngine
from rlfabric.v1 import common_pb2


def decode_log_probs_input(message: common_pb2.LogProbsInput) -> tuple[dict, float, bool]:
    batch = codec.decode_batch(message.batch, *FORWARD_BATCH)
    return batch.tensors, wire_temperature(message.temperature), message.compute_entropy


def build_trainer_service(role: str, config: RunConfig, servicer_class, add_to_server, full_name: str) -> ServiceDefinition:
    """A model role's service (actor, reference, critic): its servicer over a TrainerEngine (loaded in start()),
    or with <role>.engine sim the simulated one (rlfabric.trainer.sim_engine)."""
    registry = CollectorRegistry()
    if getattr(config, role).engine == "sim":
        from rlfabric.trainer.sim_engine import SimTrainerEngine

        engine = SimTrainerEngine(role, config, registry)
    else:
        engine = TrainerEngine(role, config, registry)
    binding = ServiceBinding(servicer_class(engine), add_to_server, full_name)
    return ServiceDefinition(role=role, bindings=[binding], engine=engine, registry=registry)
