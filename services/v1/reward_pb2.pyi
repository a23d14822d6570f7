from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_ERROR: _ClassVar[ScoreStatus]
    SCORE_STATUS_TIMEOUT: _ClassVar[ScoreStatus]
    SCORE_STATUS_CRASHED: _ClassVar[ScoreStatus]
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_ERROR: ScoreStatus
SCORE_STATUS_TIMEOUT: ScoreStatus
SCORE_STATUS_CRASHED: ScoreStatus

class ScoreItem(_message.Message):
    __slots__ = ("data_source", "prompt", "response", "response_token_ids", "ground_truth", "extra_info_json", "response_length", "prompt_messages")
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    data_source: str
    prompt: str
    response: str
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ground_truth: str
    extra_info_json: str
    response_length: int
    prompt_messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, data_source: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., ground_truth: _Optional[str] = ..., extra_info_json: _Optional[str] = ..., response_length: _Optional[int] = ..., prompt_messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("score", "status", "message", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCORE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    score: float
    status: ScoreStatus
    message: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, score: _Optional[float] = ..., status: _Optional[_Union[ScoreStatus, str]] = ..., message: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RewardServiceScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class RewardServiceScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class RewardServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardServiceGetStatusResponse(_message.Message):
    __slots__ = ("data_sources", "items_scored", "items_failed")
    DATA_SOURCES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_SCORED_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FAILED_FIELD_NUMBER: _ClassVar[int]
    data_sources: _containers.RepeatedScalarFieldContainer[str]
    items_scored: int
    items_failed: int
    def __init__(self, data_sources: _Optional[_Iterable[str]] = ..., items_scored: _Optional[int] = ..., items_failed: _Optional[int] = ...) -> None: ...
