from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentServiceRunEpisodeRequest(_message.Message):
    __slots__ = ("task_json", "base_url", "api_key", "model", "timeout_s")
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    task_json: str
    base_url: str
    api_key: str
    model: str
    timeout_s: float
    def __init__(self, task_json: _Optional[str] = ..., base_url: _Optional[str] = ..., api_key: _Optional[str] = ..., model: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AgentFailure(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AgentServiceRunEpisodeResponse(_message.Message):
    __slots__ = ("reward", "answer", "metrics", "failure")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    reward: float
    answer: str
    metrics: _containers.ScalarMap[str, float]
    failure: AgentFailure
    def __init__(self, reward: _Optional[float] = ..., answer: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., failure: _Optional[_Union[AgentFailure, _Mapping]] = ...) -> None: ...
