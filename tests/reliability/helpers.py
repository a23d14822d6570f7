"""Shared pieces of the reliability tests: real services on loopback (the tiny model), raw gRPC calls
that send arbitrary bytes, the status codes a clean refusal may have, and a known-good request per
RPC to check a service still works after a batch of bad ones."""

from __future__ import annotations

import tempfile
import time
import zlib
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.core import codec
from rlfabric.core.config import RunConfig, config_from_dict
from rlfabric.v1 import (
    actor_pb2,
    common_pb2,
    coordinator_pb2,
    critic_pb2,
    reference_pb2,
    reward_pb2,
    rollout_pb2,
    tensor_pb2,
    weight_sync_pb2,
)

# What a bad request may be answered with: the caller's fault, a state problem, or "too much".
CLEAN_REFUSALS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})
CALL_TIMEOUT_S = 60.0  # the client deadline of every fuzz call
CALL_BOUND_S = 30.0  # every answer must come well within it, even on a loaded 2-core machine

PAD = 0
SERVING = health_pb2.HealthCheckResponse.SERVING


def trainer_config(model_path, **sections) -> RunConfig:
    """Actor, reference, critic: mini-batches of 1 prompt x rollout.n 2 = 2 rows; the storage root is the
    temp folder, where the tests' checkpoint paths lie."""
    tree = {"model": {"path": str(model_path)}, "rollout": {"n": 2}, "storage": {"root": tempfile.gettempdir()},
            "actor": {"ppo_mini_batch_size": 1}, "critic": {"ppo_mini_batch_size": 1}}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return config_from_dict(tree)


# --- raw calls ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One RPC as the wire sees it."""

    service: str  # "rlfabric.v1.RewardService"
    name: str  # "Score"
    kind: str  # "unary", "server_stream" or "client_stream"

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    def __str__(self) -> str:
        return f"{self.service.removeprefix('rlfabric.v1.')}.{self.name}"


# The RPCs the reliability tests call by wire path.
SCORE = Method("rlfabric.v1.RewardService", "Score", "unary")
GENERATE = Method("rlfabric.v1.RolloutService", "Generate", "unary")
GENERATE_STREAM = Method("rlfabric.v1.RolloutService", "GenerateStream", "server_stream")
GET_STATUS = Method("rlfabric.v1.RolloutService", "GetStatus", "unary")
PAUSE = Method("rlfabric.v1.RolloutService", "Pause", "unary")
RESUME = Method("rlfabric.v1.RolloutService", "Resume", "unary")
PUSH_WEIGHTS = Method("rlfabric.v1.RolloutService", "PushWeights", "client_stream")
ACTOR_LOG_PROBS = Method("rlfabric.v1.ActorService", "ComputeLogProbs", "unary")
UPDATE_POLICY = Method("rlfabric.v1.ActorService", "UpdatePolicy", "unary")
LOAD_CHECKPOINT = Method("rlfabric.v1.ActorService", "LoadCheckpoint", "unary")
REFERENCE_LOG_PROBS = Method("rlfabric.v1.ReferenceService", "ComputeLogProbs", "unary")
COMPUTE_VALUES = Method("rlfabric.v1.CriticService", "ComputeValues", "unary")
UPDATE_VALUES = Method("rlfabric.v1.CriticService", "UpdateValues", "unary")
START_RUN = Method("rlfabric.v1.CoordinatorService", "StartRun", "unary")


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]
    seconds: float


def call_raw(channel: grpc.Channel, method: Method, payload, timeout: float = CALL_TIMEOUT_S,
             metadata=None) -> Answer:
    """Sends `payload` (bytes; a list of bytes for a client stream) without any serializer."""
    started = time.monotonic()
    responses: list[bytes] = []
    try:
        if method.kind == "unary":
            rpc = channel.unary_unary(method.path, request_serializer=None, response_deserializer=None)
            responses = [rpc(payload, timeout=timeout, metadata=metadata)]
        elif method.kind == "server_stream":
            rpc = channel.unary_stream(method.path, request_serializer=None, response_deserializer=None)
            responses = list(rpc(payload, timeout=timeout, metadata=metadata))
        else:
            rpc = channel.stream_unary(method.path, request_serializer=None, response_deserializer=None)
            responses = [rpc(iter(payload), timeout=timeout, metadata=metadata)]
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    return Answer(code, details, responses, time.monotonic() - started)


def assert_clean(answer: Answer, what: str, ok_allowed: bool = True) -> None:
    """A refusal with a caller-facing code and a message, or (where the input happens to be valid) OK;
    never INTERNAL or UNKNOWN, and never slow."""
    allowed = CLEAN_REFUSALS | ({grpc.StatusCode.OK} if ok_allowed else set())
    assert answer.code in allowed, f"{what}: {answer.code.name}: {answer.details}"
    if answer.code != grpc.StatusCode.OK:
        assert answer.details.strip(), f"{what}: {answer.code.name} without a message"
    assert answer.seconds < CALL_BOUND_S, f"{what}: took {answer.seconds:.1f} s"


def health(address: str, service: str = "readiness", credentials=None) -> int:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


# --- known-good requests ----------------------------------------------------------------------------


def sequence_batch(rows: int = 2, prompt_len: int = 4, response_len: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses in the actor's layout (every row keeps a real
    prompt token and a real response token)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 100, (rows, prompt_len), generator=g)  # [B, P]
    responses = torch.randint(4, 100, (rows, response_len), generator=g)  # [B, T]
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.int64)
    response_mask = torch.ones(rows, response_len, dtype=torch.int64)
    prompt_mask[0, 0] = 0
    response_mask[-1, -1] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, PAD)
    responses = responses.masked_fill(response_mask == 0, PAD)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),  # [B, P + T]
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "responses": responses,
        "response_mask": response_mask,
    }


def with_floats(batch: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    rows, length = batch["responses"].shape
    g = torch.Generator().manual_seed(1)
    return {**batch, **{name: -torch.rand(rows, length, generator=g) for name in names}}  # [B, T] each


UPDATE_FLOATS = {"UpdatePolicy": ("old_log_probs", "advantages"), "UpdateValues": ("values", "returns")}


def trainer_request(method: Method, tensors: dict[str, torch.Tensor], temperature: float = 1.0):
    """The request message of a trainer RPC carrying `tensors` (already-encoded Batch also accepted)."""
    batch = tensors if isinstance(tensors, codec.tensor_pb2.Batch) else codec.encode_batch(tensors)
    name = (method.service.removeprefix("rlfabric.v1."), method.name)
    if name == ("ActorService", "ComputeLogProbs"):
        return actor_pb2.ActorServiceComputeLogProbsRequest(
            input=common_pb2.LogProbsInput(batch=batch, temperature=temperature))
    if name == ("ReferenceService", "ComputeLogProbs"):
        return reference_pb2.ReferenceServiceComputeLogProbsRequest(
            input=common_pb2.LogProbsInput(batch=batch, temperature=temperature))
    if name == ("ActorService", "UpdatePolicy"):
        return actor_pb2.ActorServiceUpdatePolicyRequest(batch=batch, global_step=1)
    if name == ("CriticService", "ComputeValues"):
        return critic_pb2.CriticServiceComputeValuesRequest(batch=batch)
    if name == ("CriticService", "UpdateValues"):
        return critic_pb2.CriticServiceUpdateValuesRequest(batch=batch, global_step=1)
    raise KeyError(name)


def good_trainer_tensors(method: Method) -> dict[str, torch.Tensor]:
    return with_floats(sequence_batch(), *UPDATE_FLOATS.get(method.name, ()))


def good_score_request() -> reward_pb2.RewardServiceScoreRequest:
    return reward_pb2.RewardServiceScoreRequest(items=[
        reward_pb2.ScoreItem(data_source="openai/gsm8k", response="so #### 42", ground_truth="42"),
        reward_pb2.ScoreItem(data_source="openai/gsm8k", response="#### 41", ground_truth="42"),
    ])


def good_generate_request(cls=rollout_pb2.RolloutServiceGenerateRequest, max_tokens: int = 2):
    params = rollout_pb2.SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=7, logprobs=True)
    return cls(prompts=[rollout_pb2.Prompt(token_ids=[5, 6, 7])], sampling_params=params)


def push_weights_payload(data: bytes = b"\x00" * 8, name: str = "not.a.weight", dtype: int = 0,
                         shape: tuple[int, ...] | None = None) -> list[bytes]:
    """A well-formed PushWeights stream (manifest with the right CRC-32, then one chunk) carrying
    `data` as one tensor of one bucket; by default a weight the model does not have, so a rollout
    refuses it with INVALID_ARGUMENT after the whole transport path has run."""
    tensor = weight_sync_pb2.WeightTensorSpec(name=name, dtype=dtype or tensor_pb2.DATA_TYPE_UINT8,
                                              shape=list(shape or (len(data),)), offset=0)
    bucket = weight_sync_pb2.WeightBucket(index=0, num_bytes=len(data), crc32=zlib.crc32(data), tensors=[tensor])
    manifest = weight_sync_pb2.WeightManifest(version=1, group_id="reliability", buckets=[bucket])
    return [rollout_pb2.RolloutServicePushWeightsRequest(manifest=manifest).SerializeToString(),
            rollout_pb2.RolloutServicePushWeightsRequest(bucket_index=0, offset=0, data=data).SerializeToString()]


def start_run_request(*overrides: str) -> coordinator_pb2.CoordinatorServiceStartRunRequest:
    return coordinator_pb2.CoordinatorServiceStartRunRequest(overrides=list(overrides))
