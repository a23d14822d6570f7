from rlfabric.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class LogProbsInput(_message.Message):
    __slots__ = ("batch", "temperature", "compute_entropy", "base_model", "compute_sum_pi_squared")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SUM_PI_SQUARED_FIELD_NUMBER: _ClassVar[int]
    batch: _tensor_pb2.Batch
    temperature: float
    compute_entropy: bool
    base_model: bool
    compute_sum_pi_squared: bool
    def __init__(self, batch: _Optional[_Union[_tensor_pb2.Batch, _Mapping]] = ..., temperature: _Optional[float] = ..., compute_entropy: _Optional[bool] = ..., base_model: _Optional[bool] = ..., compute_sum_pi_squared: _Optional[bool] = ...) -> None: ...

class CheckpointLocation(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...
