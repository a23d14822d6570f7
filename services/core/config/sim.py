"""sim: the simulated engines (rollout.engine sim; actor/reference/critic.engine sim) and their cost models.

The defaults are fitted to measured figures (docs/simulation.md says which): a vLLM-like rollout replica of a
~7B model on one H100/H200-class GPU, and a trainer at 30% of that GPU's bf16 peak.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.core.config.base import Section


class SimRolloutConfig(Section):
    """The simulated rollout replica's latency model (rollout.engine sim)."""

    prefill_tokens_per_s: float = Field(20000.0, gt=0)
    """Prompt tokens one replica prefills per second; a row joining the batch holds every running row for its
    prompt's share (a prompt shared by n samples is prefilled once)."""
    decode_tokens_per_s: float = Field(80.0, gt=0)
    """Tokens per second of one sequence decoded alone (batch 1): the decode step takes 1 / this."""
    batch_knee: float = Field(48.0, gt=0)
    """The batch-size curve: a decode step of b sequences takes (1 + (b - 1) / batch_knee) / decode_tokens_per_s,
    so throughput grows with b and saturates at batch_knee x decode_tokens_per_s; the batch is capped by
    rollout.max_num_seqs."""
    response_length: Literal["lognormal", "max", "file"] = "lognormal"
    """How long each response is: lognormal = drawn with mean response_length_mean and coefficient of variation
    response_length_cv; max = every response runs to max_tokens; file = drawn from the lengths in
    response_lengths_file. Capped at max_tokens (a capped response ends with finish reason length, any other with
    an EOS token and stop)."""
    response_length_mean: int = Field(0, ge=0)
    """Mean response length in tokens (lognormal); 0 = half of the request's max_tokens."""
    response_length_cv: float = Field(0.5, ge=0)
    """Coefficient of variation of the response lengths (lognormal): standard deviation / mean."""
    response_lengths_file: str = ""
    """A JSON list of response lengths in tokens (file), e.g. measured on a real run's rollouts."""
    jitter_cv: float = Field(0.05, ge=0)
    """Noise on time: each stretch between two scheduler events runs at a rate scaled by a lognormal factor with
    this coefficient of variation (0 = deterministic)."""
    straggler_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of replicas that are stragglers (chosen by replica index and sim.seed)."""
    straggler_slowdown: float = Field(10.0, ge=1)
    """A straggler replica's prefill and decode take this many times longer."""
    failure_rate: float = Field(0.0, ge=0, le=1)
    """Probability that a request fails: it delivers a random part of its samples, then UNAVAILABLE (the router
    retries the rest on another replica); counted in rlfabric_sim_injected_failures_total."""
    vocab_size: int = Field(0, ge=0)
    """Token ids are drawn from 0..vocab_size-1; 0 = the model's (model.path's config.json), else 32000. The
    simulated model's context is rollout.max_model_len, 0 = 32768 (not model.path's, which only lends its
    tokenizer)."""
    weight_load_gb_per_s: float = Field(20.0, gt=0)
    """How fast a replica swaps in received weights (GB/s of the virtual weights): generation holds that long."""
    decode_text: bool = True
    """Decode each response's tokens to text with model.path's tokenizer (the reward scores text); false = empty
    text (faster: the reward then sees nothing)."""


class SimTrainerConfig(Section):
    """The simulated trainers' cost model (actor/reference/critic.engine sim)."""

    parameters: int = Field(0, ge=0)
    """Virtual model parameters; 0 = model.path's (counted from its safetensors headers), else 7e9."""
    gpus: int = Field(8, ge=1)
    """GPUs the virtual trainer spans (its world size; the service itself is one process)."""
    gpu_tflops: float = Field(989.0, gt=0)
    """Peak dense bf16 TFLOP/s of one GPU (H100 SXM / H200: 989)."""
    mfu: float = Field(0.3, gt=0, le=1)
    """Model FLOPs utilisation: an update costs 6 x parameters x tokens FLOPs, a forward 2 x parameters x tokens,
    at gpus x gpu_tflops x mfu."""
    bytes_per_param: float = Field(2.0, gt=0)
    """Bytes a weight sync moves per parameter (2 = bf16)."""
    gather_gb_per_s: float = Field(40.0, gt=0)
    """How fast the actor gathers and packs its weights for a sync (GB/s)."""
    link_gb_per_s: float = Field(3.0, gt=0)
    """Bandwidth of the weight-sync link (GB/s); a broadcast reaches every replica in about one transfer's time."""
    link_latency_s: float = Field(0.005, ge=0)
    """Fixed cost of one weight-sync transfer."""
    checkpoint_gb_per_s: float = Field(2.0, gt=0)
    """How fast a checkpoint (weights + optimizer: 16 bytes per parameter, trainable roles) is written or read."""


class SimConfig(Section):
    """Simulated engines: rollout replicas and trainers that take modelled time and no model weights, behind
    the real services, router, coordinator and weight-sync protocol (docs/simulation.md)."""

    time_scale: float = Field(1.0, gt=0)
    """Real seconds per simulated second: 0.01 runs a 60 s simulated generation in 0.6 s. Every duration the
    models give is multiplied by it; measured times (timing_s/*) are real, sim/time_scale is in the metrics."""
    seed: int = 0
    """Seed of the simulation's draws (lengths, jitter, stragglers, failures)."""
    rollout: SimRolloutConfig = SimRolloutConfig()
    """The simulated rollout replica (rollout.engine sim)."""
    trainer: SimTrainerConfig = SimTrainerConfig()
    """The simulated actor, reference and critic (<role>.engine sim)."""
