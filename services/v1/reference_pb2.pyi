from rlfabric.v1 import common_pb2 as _common_pb2
from rlfabric.v1 import tensor_pb2 as _tensor_pb2
from rlfabric.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReferenceServiceComputeLogProbsRequest(_message.Message):
    __slots__ = ("input",)
    INPUT_FIELD_NUMBER: _ClassVar[int]
    input: _common_pb2.LogProbsInput
    def __init__(self, input: _Optional[_Union[_common_pb2.LogProbsInput, _Mapping]] = ...) -> None: ...

class ReferenceServiceComputeLogProbsResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _tensor_pb2.Batch
    def __init__(self, outputs: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ...) -> None: ...

class ReferenceServiceJoinWeightSyncGroupRequest(_message.Message):
    __slots__ = ("group", "rank")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    group: _weight_sync_pb2.WeightSyncGroup
    rank: int
    def __init__(self, group: _Optional[_Union[_weight_sync_pb2.WeightSyncGroup, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class ReferenceServiceJoinWeightSyncGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReferenceServiceReceiveWeightsRequest(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _weight_sync_pb2.WeightManifest
    def __init__(self, manifest: _Optional[_Union[_weight_sync_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class ReferenceServiceReceiveWeightsResponse(_message.Message):
    __slots__ = ("version", "phases")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    version: int
    phases: _weight_sync_pb2.WeightSyncPhases
    def __init__(self, version: _Optional[int] = ..., phases: _Optional[_Union[_weight_sync_pb2.WeightSyncPhases, _Mapping]] = ...) -> None: ...

class ReferenceServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReferenceServiceGetStatusResponse(_message.Message):
    __slots__ = ("model", "weight_version", "device")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    weight_version: int
    device: _weight_sync_pb2.WeightSyncDevice
    def __init__(self, model: _Optional[str] = ..., weight_version: _Optional[int] = ..., device: _Optional[_Union[_weight_sync_pb2.WeightSyncDevice, _Mapping]] = ...) -> None: ...
