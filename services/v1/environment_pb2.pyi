from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_STATUS_UNSPECIFIED: _ClassVar[StepStatus]
    STEP_STATUS_OK: _ClassVar[StepStatus]
    STEP_STATUS_UNKNOWN_TOOL: _ClassVar[StepStatus]
    STEP_STATUS_INVALID_ARGUMENTS: _ClassVar[StepStatus]
    STEP_STATUS_TOOL_ERROR: _ClassVar[StepStatus]
    STEP_STATUS_TOOL_TIMEOUT: _ClassVar[StepStatus]
STEP_STATUS_UNSPECIFIED: StepStatus
STEP_STATUS_OK: StepStatus
STEP_STATUS_UNKNOWN_TOOL: StepStatus
STEP_STATUS_INVALID_ARGUMENTS: StepStatus
STEP_STATUS_TOOL_ERROR: StepStatus
STEP_STATUS_TOOL_TIMEOUT: StepStatus

class Task(_message.Message):
    __slots__ = ("environment", "prompt", "ground_truth", "extra_info_json")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    environment: str
    prompt: str
    ground_truth: str
    extra_info_json: str
    def __init__(self, environment: _Optional[str] = ..., prompt: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info_json: _Optional[str] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("text", "tool_calls")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class EnvironmentServiceResetRequest(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class EnvironmentServiceResetResponse(_message.Message):
    __slots__ = ("session_id", "observation", "tools")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation: Observation
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    def __init__(self, session_id: _Optional[str] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ...) -> None: ...

class EnvironmentServiceStepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: Action
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[_Union[Action, _Mapping]] = ...) -> None: ...

class EnvironmentServiceStepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "status", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    observation: Observation
    reward: float
    done: bool
    status: StepStatus
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, observation: _Optional[_Union[Observation, _Mapping]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., status: _Optional[_Union[StepStatus, str]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EnvironmentServiceCloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EnvironmentServiceCloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvironmentServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvironmentServiceGetStatusResponse(_message.Message):
    __slots__ = ("environments", "sessions_open", "sessions_started", "sessions_expired", "steps")
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPEN_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_STARTED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedScalarFieldContainer[str]
    sessions_open: int
    sessions_started: int
    sessions_expired: int
    steps: int
    def __init__(self, environments: _Optional[_Iterable[str]] = ..., sessions_open: _Optional[int] = ..., sessions_started: _Optional[int] = ..., sessions_expired: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...
