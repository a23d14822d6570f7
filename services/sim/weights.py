"""What a simulated weight sync moves: a tiny real payload through the real protocol (manifest, buckets,
checksums, version numbers), and the modelled cost of the virtual weights it stands for."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from rlfabric.core.config import RunConfig
from rlfabric.weight_sync.manifest import WeightLimits

PAYLOAD_NAME = "simulated_weights"
PAYLOAD_SHAPE = (256,)  # 1 KiB of float32: what the wire carries
DEFAULT_PARAMETERS = 7_000_000_000


def payload(version: float) -> dict[str, torch.Tensor]:
    """The simulated actor's weights: one small tensor holding its update count (a receiver can tell which
    version arrived)."""
    return {PAYLOAD_NAME: torch.full(PAYLOAD_SHAPE, float(version))}


def payload_limits() -> WeightLimits:
    return WeightLimits({PAYLOAD_NAME: PAYLOAD_SHAPE}, {PAYLOAD_NAME: torch.float32}, "the simulated model")


def virtual_parameters(config: RunConfig) -> int:
    """sim.trainer.parameters, else model.path's parameter count, else 7e9."""
    return config.sim.trainer.parameters or _checkpoint_parameters(config.model.path) or DEFAULT_PARAMETERS


@cache
def _checkpoint_parameters(path: str) -> int:
    limits = WeightLimits.from_checkpoint(path) if path else None
    return sum(math.prod(shape) for shape in limits.shapes.values()) if limits else 0


@dataclass(frozen=True)
class SyncCost:
    """Real seconds of one simulated weight sync's phases."""

    virtual_bytes: int
    gather_s: float  # the actor gathers and packs
    wire_s: float  # one broadcast over the link (every receiver at once)
    apply_s: float  # a rollout replica swaps the weights in

    @classmethod
    def of(cls, config: RunConfig) -> SyncCost:
        sim = config.sim
        num_bytes = int(virtual_parameters(config) * sim.trainer.bytes_per_param)
        scale = sim.time_scale
        return cls(num_bytes, num_bytes / (sim.trainer.gather_gb_per_s * 1e9) * scale,
                   (sim.trainer.link_latency_s + num_bytes / (sim.trainer.link_gb_per_s * 1e9)) * scale,
                   num_bytes / (sim.rollout.weight_load_gb_per_s * 1e9) * scale)
