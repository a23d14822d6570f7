"""DAPO's soft overlong punishment: a penalty that grows linearly over the last buffer_length tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OverlongConfig:
    """DAPO overlong buffer (VeRL: reward_model.overlong_buffer.* and data.max_response_length)."""

    enable: bool = False
    """Add the overlong penalty to every score."""
    max_response_length: int = 1024
    """Lmax: the rollout's response length limit, in tokens."""
    buffer_length: int = 256
    """b: the penalty ramps from 0 at Lmax - b tokens to -penalty_factor at Lmax tokens."""
    penalty_factor: float = 1.0
    """f: the penalty at Lmax tokens is -f."""

    def __post_init__(self) -> None:
        if self.enable and not 0 < self.buffer_length <= self.max_response_length:
            raise ValueError(
                f"buffer_length must be in (0, max_response_length={self.max_response_length}], "
                f"got {self.buffer_length}"
            )


def overlong_penalty(
    response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float
) -> float:
    """min(-(L - (Lmax - b)) / b * f, 0): 0 up to Lmax - b tokens, then down to -f at Lmax."""
    expected_length = max_response_length - buffer_length
    exceed_length = response_length - expected_length
    return min(-exceed_length / buffer_length * penalty_factor, 0.0)


def apply_overlong_penalty(score: float, response_length: int, config: OverlongConfig) -> tuple[float, float]:
    """(score + penalty, penalty); the score is unchanged when the config is disabled."""
    if not config.enable:
        return score, 0.0
    penalty = overlong_penalty(
        response_length, config.max_response_length, config.buffer_length, config.penalty_factor
    )
    return score + penalty, penalty
