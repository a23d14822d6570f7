"""The simulated trainers' cost model (sim.trainer): an update costs 6 x parameters x tokens FLOPs (forward and
backward), a forward 2 x parameters x tokens, at gpus x gpu_tflops x mfu; checkpoints move 16 bytes per
parameter (bf16 weights, fp32 master weights and two Adam moments) of a trained role, 2 of a frozen one."""

from __future__ import annotations

from dataclasses import dataclass

from rlfabric.core.config import RunConfig
from rlfabric.sim.weights import virtual_parameters

CHECKPOINT_BYTES_PER_PARAM = {True: 16, False: 2}  # trainable or not


@dataclass(frozen=True)
class TrainerCost:
    parameters: int
    flops_per_s: float  # what the virtual GPUs deliver together
    checkpoint_bytes_per_s: float
    time_scale: float

    @classmethod
    def of(cls, config: RunConfig) -> TrainerCost:
        model = config.sim.trainer
        return cls(virtual_parameters(config), model.gpus * model.gpu_tflops * 1e12 * model.mfu,
                   model.checkpoint_gb_per_s * 1e9, config.sim.time_scale)

    def forward_seconds(self, tokens: int) -> float:
        return 2 * self.parameters * tokens / self.flops_per_s * self.time_scale

    def update_seconds(self, tokens: int, epochs: int = 1) -> float:
        return 6 * self.parameters * tokens * epochs / self.flops_per_s * self.time_scale

    def checkpoint_bytes(self, trainable: bool) -> int:
        return self.parameters * CHECKPOINT_BYTES_PER_PARAM[trainable]

    def checkpoint_seconds(self, trainable: bool) -> float:
        return self.checkpoint_bytes(trainable) / self.checkpoint_bytes_per_s * self.time_scale
