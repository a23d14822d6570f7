from rlfabric.v1 import common_pb2 as _common_pb2
from rlfabric.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class Prompt(_message.Message):
    __slots__ = ("token_ids", "messages", "task")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    task: AgentTask
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., task: _Optional[_Union[AgentTask, _Mapping]] = ...) -> None: ...

class AgentTask(_message.Message):
    __slots__ = ("environment", "ground_truth", "extra_info_json")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    environment: str
    ground_truth: str
    extra_info_json: str
    def __init__(self, environment: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info_json: _Optional[str] = ...) -> None: ...

class MultiTurnParams(_message.Message):
    __slots__ = ("env_address", "max_turns", "max_total_tokens", "tool_call_format", "env_timeout_s")
    ENV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ENV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    env_address: str
    max_turns: int
    max_total_tokens: int
    tool_call_format: str
    env_timeout_s: float
    def __init__(self, env_address: _Optional[str] = ..., max_turns: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., tool_call_format: _Optional[str] = ..., env_timeout_s: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "logprobs", "multi_turn")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MULTI_TURN_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: bool
    multi_turn: MultiTurnParams
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., multi_turn: _Optional[_Union[MultiTurnParams, _Mapping]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "weight_version", "text", "version_spans", "routed_experts", "prompt_token_ids", "loss_mask", "turns", "agent_status", "agent_error", "env_reward")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    AGENT_STATUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ERROR_FIELD_NUMBER: _ClassVar[int]
    ENV_REWARD_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    weight_version: int
    text: str
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    routed_experts: RoutedExperts
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    turns: _containers.RepeatedCompositeFieldContainer[AgentTurn]
    agent_status: str
    agent_error: str
    env_reward: float
    def __init__(self, prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., text: _Optional[str] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., turns: _Optional[_Iterable[_Union[AgentTurn, _Mapping]]] = ..., agent_status: _Optional[str] = ..., agent_error: _Optional[str] = ..., env_reward: _Optional[float] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("ids", "layers", "top_k", "id_bytes")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ID_BYTES_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    layers: int
    top_k: int
    id_bytes: int
    def __init__(self, ids: _Optional[bytes] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ..., id_bytes: _Optional[int] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "first_token")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    version: int
    first_token: int
    def __init__(self, version: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class AgentTurn(_message.Message):
    __slots__ = ("model_tokens", "observation_tokens", "tool_calls", "step_status", "reward", "weight_version", "env_seconds", "finish_reason")
    MODEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STEP_STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    model_tokens: int
    observation_tokens: int
    tool_calls: _containers.RepeatedScalarFieldContainer[str]
    step_status: str
    reward: float
    weight_version: int
    env_seconds: float
    finish_reason: str
    def __init__(self, model_tokens: _Optional[int] = ..., observation_tokens: _Optional[int] = ..., tool_calls: _Optional[_Iterable[str]] = ..., step_status: _Optional[str] = ..., reward: _Optional[float] = ..., weight_version: _Optional[int] = ..., env_seconds: _Optional[float] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class RolloutServiceGenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling_params")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling_params: SamplingParams
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class RolloutServiceGenerateResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class RolloutServiceGenerateStreamRequest(_message.Message):
    __slots__ = ("prompts", "sampling_params")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling_params: SamplingParams
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class RolloutServiceGenerateStreamResponse(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: Sample
    def __init__(self, sample: _Optional[_Union[Sample, _Mapping]] = ...) -> None: ...

class RolloutServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceGetStatusResponse(_message.Message):
    __slots__ = ("engine", "model", "weight_version", "queue_depth", "kv_cache_usage", "paused", "sleeping", "rss_bytes", "device_memory_bytes", "device")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    model: str
    weight_version: int
    queue_depth: int
    kv_cache_usage: float
    paused: bool
    sleeping: bool
    rss_bytes: int
    device_memory_bytes: int
    device: _weight_sync_pb2.WeightSyncDevice
    def __init__(self, engine: _Optional[str] = ..., model: _Optional[str] = ..., weight_version: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., paused: _Optional[bool] = ..., sleeping: _Optional[bool] = ..., rss_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., device: _Optional[_Union[_weight_sync_pb2.WeightSyncDevice, _Mapping]] = ...) -> None: ...

class RolloutServicePauseRequest(_message.Message):
    __slots__ = ("abort",)
    ABORT_FIELD_NUMBER: _ClassVar[int]
    abort: bool
    def __init__(self, abort: _Optional[bool] = ...) -> None: ...

class RolloutServicePauseResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class RolloutServiceResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceSleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class RolloutServiceSleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceWakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutServiceWakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceJoinWeightSyncGroupRequest(_message.Message):
    __slots__ = ("group", "rank")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    group: _weight_sync_pb2.WeightSyncGroup
    rank: int
    def __init__(self, group: _Optional[_Union[_weight_sync_pb2.WeightSyncGroup, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class RolloutServiceJoinWeightSyncGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutServiceReceiveWeightsRequest(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _weight_sync_pb2.WeightManifest
    def __init__(self, manifest: _Optional[_Union[_weight_sync_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class RolloutServiceReceiveWeightsResponse(_message.Message):
    __slots__ = ("version", "paused_seconds", "phases")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    version: int
    paused_seconds: float
    phases: _weight_sync_pb2.WeightSyncPhases
    def __init__(self, version: _Optional[int] = ..., paused_seconds: _Optional[float] = ..., phases: _Optional[_Union[_weight_sync_pb2.WeightSyncPhases, _Mapping]] = ...) -> None: ...

class RolloutServicePushWeightsRequest(_message.Message):
    __slots__ = ("manifest", "bucket_index", "offset", "data")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    manifest: _weight_sync_pb2.WeightManifest
    bucket_index: int
    offset: int
    data: bytes
    def __init__(self, manifest: _Optional[_Union[_weight_sync_pb2.WeightManifest, _Mapping]] = ..., bucket_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RolloutServicePushWeightsResponse(_message.Message):
    __slots__ = ("version", "paused_seconds", "phases", "relayed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    version: int
    paused_seconds: float
    phases: _weight_sync_pb2.WeightSyncPhases
    relayed: _containers.RepeatedCompositeFieldContainer[RelayedPush]
    def __init__(self, version: _Optional[int] = ..., paused_seconds: _Optional[float] = ..., phases: _Optional[_Union[_weight_sync_pb2.WeightSyncPhases, _Mapping]] = ..., relayed: _Optional[_Iterable[_Union[RelayedPush, _Mapping]]] = ...) -> None: ...

class RolloutServicePushHeldWeightsRequest(_message.Message):
    __slots__ = ("targets", "version", "hop_timeout_s")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    version: int
    hop_timeout_s: float
    def __init__(self, targets: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., hop_timeout_s: _Optional[float] = ...) -> None: ...

class RolloutServicePushHeldWeightsResponse(_message.Message):
    __slots__ = ("pushes", "sent_bytes")
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[RelayedPush]
    sent_bytes: int
    def __init__(self, pushes: _Optional[_Iterable[_Union[RelayedPush, _Mapping]]] = ..., sent_bytes: _Optional[int] = ...) -> None: ...

class RelayedPush(_message.Message):
    __slots__ = ("address", "version", "paused_seconds", "error", "phases")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    address: str
    version: int
    paused_seconds: float
    error: str
    phases: _weight_sync_pb2.WeightSyncPhases
    def __init__(self, address: _Optional[str] = ..., version: _Optional[int] = ..., paused_seconds: _Optional[float] = ..., error: _Optional[str] = ..., phases: _Optional[_Union[_weight_sync_pb2.WeightSyncPhases, _Mapping]] = ...) -> None: ...
