"""weight_sync: how the actor's weights reach the rollout and the reference."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
)

from rlfabric.core.config.base import Section


class WeightSyncConfig(Section):
    """How the actor's weights reach the rollout replicas after every update."""

    transport: Literal["auto", "nccl", "gloo", "grpc", "cuda_ipc"] = "auto"
    """auto = decided at run start from the GPUs the actor and the rollout replicas report (UUIDs): nccl when each
    holds a GPU of its own; cuda_ipc when every replica is on the actor's GPU (one GPU for everything: the actor
    lends its packed buckets' GPU memory, no byte leaves the GPU; gloo with SGLang); gloo when one is on CPU or
    GPUs are shared otherwise. nccl where two members share a GPU or one is on CPU, and cuda_ipc where a replica
    is not on the actor's GPU, are refused before the run starts. grpc = chunked stream (works anywhere)."""
    bucket_mb: int = Field(64, gt=0)
    """Weights move in flattened buckets of about this many MiB. gloo, nccl and cuda_ipc pipeline them: bucket
    k+1 is packed while bucket k is on the wire, and the actor stages two buckets at a time (not a second copy of
    the model), so smaller buckets overlap more; each bucket costs one collective."""
    timeout_s: float = Field(120.0, gt=0)
    """Every collective and stream of a sync fails after this long (a dead peer never hangs the run)."""
    max_timeout_s: float = Field(600.0, gt=0, validate_default=True)
    """Longest timeout_s the actor accepts in OpenWeightSyncGroup, and a receiver (rollout, reference) in
    JoinWeightSyncGroup (more is INVALID_ARGUMENT): a join or collective holds a thread that long; >= timeout_s."""
    max_open_groups: int = Field(4, ge=1)
    """Weight-sync groups the actor keeps open; one more evicts the longest-unused one not mid-sync."""
    host: str = ""
    """Address receivers use to reach the actor's gloo store, which listens on it only; empty = server.host, or
    this machine's hostname when server.host is a wildcard (0.0.0.0)."""
    delta: bool = False
    """Send only what changed since the last sync (gloo, nccl and grpc; rollout replicas, full weights): the actor
    keeps what it last sent in the rollout's dtype and packs the next version beside it (two copies of the model
    in host memory; gloo and nccl then pack before sending instead of pipelining), each replica keeps what it
    received (one more copy), and each tensor's change travels (its changed elements, or the XOR of its bit
    patterns, zstd-compressed: the smaller) with the CRC-32 of the result, which the replica checks. At RL learning
    rates few bfloat16 elements change per step. A replica that does not hold the last version, or whose result
    does not check out, gets the full weights (weight_sync/delta_fallback_full). The first sync is full, and over
    gloo and nccl so is the first after the group is rebuilt; over grpc a joiner catches up from a peer replica
    instead (weight_sync/catchup_from_peer) and that sync stays a delta. It saves bytes, and time where the link
    is slower than the actor's encoding (docs: training, delta weight sync)."""
    relay: Literal["none", "chain"] = "none"
    """With transport grpc: chain = the actor pushes each sync to the first rollout replica alone and every replica
    forwards each chunk to the next as soon as it has it, so the actor sends one copy of the model whatever the
    number of replicas and a sync takes about one wire time plus a chunk per hop (weight_sync/actor_egress_bytes).
    A replica that fails mid-relay is routed around (the next one gets the whole push again) and gets a full sync
    when it answers again; none = the actor pushes to every replica itself."""
    lora: Literal["auto", "adapter", "merged"] = "auto"
    """With actor.lora: adapter = each sync sends the LoRA adapters alone (rank x (in + out) per adapted layer) and
    the rollout engine applies them on its base model (hf: peft; vllm: its LoRA API); merged = each sync sends the
    full merged weights under the base model's names (any engine); auto = adapter when rollout.engine can load
    adapters (hf, vllm), else merged (sglang)."""

    @field_validator("relay")
    @classmethod
    def _relay_over_grpc(cls, value: str, info: ValidationInfo) -> str:
        if value != "none" and info.data.get("transport") != "grpc":
            raise ValueError(f"relay {value} runs over weight_sync.transport grpc, not {info.data.get('transport')}")
        return value

    @field_validator("max_timeout_s")
    @classmethod
    def _at_least_timeout(cls, value: float, info: ValidationInfo) -> float:
        if value < info.data.get("timeout_s", 0):
            raise ValueError(f"must be >= weight_sync.timeout_s ({info.data['timeout_s']:g})")
        return value


ADAPTER_ENGINES = ("hf", "vllm")  # rollout engines that load LoRA adapters (weight_sync.lora: adapter)
