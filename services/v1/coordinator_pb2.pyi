from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]
    RUN_STATE_COMPLETED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_PAUSED: RunState
RUN_STATE_COMPLETED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_FAILED: RunState

class CoordinatorServiceStartRunRequest(_message.Message):
    __slots__ = ("overrides",)
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    overrides: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, overrides: _Optional[_Iterable[str]] = ...) -> None: ...

class CoordinatorServiceStartRunResponse(_message.Message):
    __slots__ = ("run_id", "start_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    start_step: int
    def __init__(self, run_id: _Optional[str] = ..., start_step: _Optional[int] = ...) -> None: ...

class CoordinatorServiceGetRunStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceGetRunStatusResponse(_message.Message):
    __slots__ = ("run_id", "state", "step", "total_steps", "phase", "last_metrics", "weight_version", "error")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    step: int
    total_steps: int
    phase: str
    last_metrics: _containers.ScalarMap[str, float]
    weight_version: int
    error: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., phase: _Optional[str] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., weight_version: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class CoordinatorServiceStreamMetricsRequest(_message.Message):
    __slots__ = ("from_step",)
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    def __init__(self, from_step: _Optional[int] = ...) -> None: ...

class CoordinatorServiceStreamMetricsResponse(_message.Message):
    __slots__ = ("step", "metrics", "timestamp")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    timestamp: float
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class CoordinatorServicePauseRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServicePauseRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceResumeRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceResumeRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceStopRunRequest(_message.Message):
    __slots__ = ("save_checkpoint", "skip_checkpoint")
    SAVE_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    save_checkpoint: bool
    skip_checkpoint: bool
    def __init__(self, save_checkpoint: _Optional[bool] = ..., skip_checkpoint: _Optional[bool] = ...) -> None: ...

class CoordinatorServiceStopRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceSaveCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceSaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CoordinatorServiceRegisterRolloutReplicaRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class CoordinatorServiceRegisterRolloutReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoordinatorServiceDeregisterRolloutReplicaRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class CoordinatorServiceDeregisterRolloutReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
