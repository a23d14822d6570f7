"""What the three model roles' clients share (rlfabric.actor.client, rlfabric.reference.client,
rlfabric.critic.client): the batch schemas each request is checked against (by the servicer while decoding,
by the in-process client before calling the engine), the wire helpers, the checkpoint interface of the two
trained roles, and the in-process base over a TrainerEngine."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from rlfabric.core import codec
from rlfabric.core.client import RoleInterface
from rlfabric.trainer.batch import POSITION_IDS, ROUTES, SEQUENCE
from rlfabric.v1 import common_pb2

if TYPE_CHECKING:
    from rlfabric.trainer.engine import TrainerEngine

Tensors = Mapping[str, torch.Tensor]

# The (required, optional) tensors of each request's batch.
# + routed_experts (the actor's, with actor.router_replay)
FORWARD_BATCH = (SEQUENCE, (POSITION_IDS, ROUTES))  # ComputeLogProbs, ComputeValues
# + old_log_probs, unless the update is one optimizer step; + rollout_is_weights with rollout correction
POLICY_UPDATE_BATCH = ((*SEQUENCE, "advantages"),
                       (POSITION_IDS, "old_log_probs", "ref_log_probs", "rollout_is_weights", ROUTES))
VALUE_UPDATE_BATCH = ((*SEQUENCE, "values", "returns"), (POSITION_IDS,))


def wire_temperature(temperature: float) -> float:
    """A request's sampling temperature as the engine takes it: 0 (the proto default) means 1.0."""
    return temperature if temperature != 0 else 1.0


class TrainableInterface(RoleInterface):
    """What the two trained roles (actor, critic) share: their checkpoints."""

    @abstractmethod
    async def save_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        """Bytes written."""

    @abstractmethod
    async def load_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        """The optimizer step restored."""


def log_probs_input(temperature: float, compute_entropy: bool, base_model: bool = False,
                    compute_sum_pi_squared: bool = False) -> common_pb2.LogProbsInput:
    """A request's LogProbsInput but its batch (codec.serialized_with_batch writes that, at ("input", "batch"))."""
    return common_pb2.LogProbsInput(temperature=temperature, compute_entropy=compute_entropy, base_model=base_model,
                                    compute_sum_pi_squared=compute_sum_pi_squared)


def decoded_tensors(batch) -> dict[str, torch.Tensor]:
    return codec.decode_batch(batch, allow_empty=True, copy=True).tensors


class LocalTrainerClient:
    """What the three in-process clients share: the engine, get_status, close."""

    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def _forward(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                       base_model: bool = False, compute_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        codec.check_batch(batch, *FORWARD_BATCH)
        return await self.engine.compute(dict(batch), wire_temperature(temperature), compute_entropy,
                                         base_model=base_model, with_sum_pi_squared=compute_sum_pi_squared)

    async def _update(self, batch: Tensors, schema, global_step: int) -> dict[str, float]:
        codec.check_batch(batch, *schema)
        return await self.engine.update(dict(batch), global_step)

    async def save_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        return await self.engine.save_checkpoint(str(path))

    async def load_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        return await self.engine.load_checkpoint(str(path))

    async def close(self) -> None:
        """Nothing to release: the engine belongs to whoever started it."""
