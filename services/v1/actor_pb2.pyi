from rlfabric.v1 import common_pb2 as _common_pb2
from rlfabric.v1 import tensor_pb2 as _tensor_pb2
from rlfabric.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ActorServiceComputeLogProbsRequest(_message.Message):
    __slots__ = ("input",)
    INPUT_FIELD_NUMBER: _ClassVar[int]
    input: _common_pb2.LogProbsInput
    def __init__(self, input: _Optional[_Union[_common_pb2.LogProbsInput, _Mapping]] = ...) -> None: ...

class ActorServiceComputeLogProbsResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _tensor_pb2.Batch
    def __init__(self, outputs: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ...) -> None: ...

class ActorServiceUpdatePolicyRequest(_message.Message):
    __slots__ = ("batch", "global_step")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    batch: _tensor_pb2.Batch
    global_step: int
    def __init__(self, batch: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ..., global_step: _Optional[int] = ...) -> None: ...

class ActorServiceUpdatePolicyResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ActorServiceUpdatePolicyStreamRequest(_message.Message):
    __slots__ = ("header", "rows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: UpdatePolicyStreamHeader
    rows: _tensor_pb2.RaggedRows
    def __init__(self, header: _Optional[_Union[UpdatePolicyStreamHeader, _Mapping]] = ..., rows: _Optional[_Union[_tensor_pb2.RaggedRows, _Mapping]] = ...) -> None: ...

class UpdatePolicyStreamHeader(_message.Message):
    __slots__ = ("global_step", "num_rows", "pad_token_id", "prompt_width", "response_width")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    num_rows: int
    pad_token_id: int
    prompt_width: int
    response_width: int
    def __init__(self, global_step: _Optional[int] = ..., num_rows: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., prompt_width: _Optional[int] = ..., response_width: _Optional[int] = ...) -> None: ...

class ActorServiceUpdatePolicyStreamResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ActorServiceSaveCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class ActorServiceSaveCheckpointResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class ActorServiceLoadCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class ActorServiceLoadCheckpointResponse(_message.Message):
    __slots__ = ("optimizer_step",)
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: int
    def __init__(self, optimizer_step: _Optional[int] = ...) -> None: ...

class ActorServiceExportHFRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ActorServiceExportHFResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class ActorServiceOpenWeightSyncGroupRequest(_message.Message):
    __slots__ = ("transport", "num_receivers", "bucket_bytes", "target_dtype", "timeout_s", "grpc_receiver_addresses", "delta", "relay", "delta_base_from")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TARGET_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GRPC_RECEIVER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FROM_FIELD_NUMBER: _ClassVar[int]
    transport: _weight_sync_pb2.WeightTransport
    num_receivers: int
    bucket_bytes: int
    target_dtype: _tensor_pb2.DataType
    timeout_s: float
    grpc_receiver_addresses: _containers.RepeatedScalarFieldContainer[str]
    delta: bool
    relay: str
    delta_base_from: str
    def __init__(self, transport: _Optional[_Union[_weight_sync_pb2.WeightTransport, str]] = ..., num_receivers: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., target_dtype: _Optional[_Union[_tensor_pb2.DataType, str]] = ..., timeout_s: _Optional[float] = ..., grpc_receiver_addresses: _Optional[_Iterable[str]] = ..., delta: _Optional[bool] = ..., relay: _Optional[str] = ..., delta_base_from: _Optional[str] = ...) -> None: ...

class ActorServiceOpenWeightSyncGroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _weight_sync_pb2.WeightSyncGroup
    def __init__(self, group: _Optional[_Union[_weight_sync_pb2.WeightSyncGroup, _Mapping]] = ...) -> None: ...

class ActorServicePrepareWeightSyncRequest(_message.Message):
    __slots__ = ("group_id", "version", "delta_base_version")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    version: int
    delta_base_version: int
    def __init__(self, group_id: _Optional[str] = ..., version: _Optional[int] = ..., delta_base_version: _Optional[int] = ...) -> None: ...

class ActorServicePrepareWeightSyncResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _weight_sync_pb2.WeightManifest
    def __init__(self, manifest: _Optional[_Union[_weight_sync_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class ActorServiceBroadcastWeightsRequest(_message.Message):
    __slots__ = ("group_id", "version")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    version: int
    def __init__(self, group_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ActorServiceBroadcastWeightsResponse(_message.Message):
    __slots__ = ("num_bytes", "seconds", "pushes", "phases", "egress_bytes")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    EGRESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    seconds: float
    pushes: _containers.RepeatedCompositeFieldContainer[WeightPushResult]
    phases: _weight_sync_pb2.WeightSyncPhases
    egress_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., pushes: _Optional[_Iterable[_Union[WeightPushResult, _Mapping]]] = ..., phases: _Optional[_Union[_weight_sync_pb2.WeightSyncPhases, _Mapping]] = ..., egress_bytes: _Optional[int] = ...) -> None: ...

class WeightPushResult(_message.Message):
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

class ActorServiceCloseWeightSyncGroupRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class ActorServiceCloseWeightSyncGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ActorServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ActorServiceGetStatusResponse(_message.Message):
    __slots__ = ("model", "world_size", "optimizer_step", "num_parameters", "device")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    world_size: int
    optimizer_step: int
    num_parameters: int
    device: _weight_sync_pb2.WeightSyncDevice
    def __init__(self, model: _Optional[str] = ..., world_size: _Optional[int] = ..., optimizer_step: _Optional[int] = ..., num_parameters: _Optional[int] = ..., device: _Optional[_Union[_weight_sync_pb2.WeightSyncDevice, _Mapping]] = ...) -> None: ...
