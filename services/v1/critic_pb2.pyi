from rlfabric.v1 import common_pb2 as _common_pb2
from rlfabric.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CriticServiceComputeValuesRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: _tensor_pb2.Batch
    def __init__(self, batch: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ...) -> None: ...

class CriticServiceComputeValuesResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _tensor_pb2.Batch
    def __init__(self, outputs: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ...) -> None: ...

class CriticServiceUpdateValuesRequest(_message.Message):
    __slots__ = ("batch", "global_step")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    batch: _tensor_pb2.Batch
    global_step: int
    def __init__(self, batch: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ..., global_step: _Optional[int] = ...) -> None: ...

class CriticServiceUpdateValuesResponse(_message.Message):
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

class CriticServiceSaveCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class CriticServiceSaveCheckpointResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class CriticServiceLoadCheckpointRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _common_pb2.CheckpointLocation
    def __init__(self, location: _Optional[_Union[_common_pb2.CheckpointLocation, _Mapping]] = ...) -> None: ...

class CriticServiceLoadCheckpointResponse(_message.Message):
    __slots__ = ("optimizer_step",)
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: int
    def __init__(self, optimizer_step: _Optional[int] = ...) -> None: ...

class CriticServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CriticServiceGetStatusResponse(_message.Message):
    __slots__ = ("model", "world_size", "optimizer_step")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    model: str
    world_size: int
    optimizer_step: int
    def __init__(self, model: _Optional[str] = ..., world_size: _Optional[int] = ..., optimizer_step: _Optional[int] = ...) -> None: ...
