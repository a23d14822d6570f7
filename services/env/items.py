"""The domain types of the environment service (what Reset and Step take and give), and the contract
check every answer of an environment passes, in the service (Python environments) and in the client
(an environment in any language behind the gRPC service): an answer that breaks it is InvalidArgument."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlfabric.core.errors import InvalidArgument

# How a step's tool calls went (StepStatus on the wire): the model reads any failure as an observation.
STEP_OK = "ok"
STEP_UNKNOWN_TOOL = "unknown_tool"  # a call named a tool the environment does not have
STEP_INVALID_ARGUMENTS = "invalid_arguments"  # arguments not a JSON object of what the tool takes, or no parse
STEP_TOOL_ERROR = "tool_error"  # the tool failed
STEP_TOOL_TIMEOUT = "tool_timeout"  # the tool ran past its own time limit
STEP_STATUSES = (STEP_OK, STEP_UNKNOWN_TOOL, STEP_INVALID_ARGUMENTS, STEP_TOOL_ERROR, STEP_TOOL_TIMEOUT)

MESSAGE_ROLES = ("tool", "user", "system")  # what an observation may hold (never "assistant": that is the model)


@dataclass(frozen=True)
class Task:
    """One data row a session starts on."""

    environment: str = ""
    """The environment's registered name; empty = env.name."""
    prompt: str = ""
    """The row's prompt as text."""
    ground_truth: str = ""
    """reward_model.ground_truth of the row."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """extra_info of the row; tools_kwargs in it as VeRL spells them: {"TOOL": {"create_kwargs": {...}}}."""

    def create_kwargs(self, tool: str) -> dict[str, Any]:
        """extra_info.tools_kwargs.TOOL.create_kwargs ({} when absent)."""
        tools_kwargs = self.extra_info.get("tools_kwargs") or {}
        kwargs = (tools_kwargs.get(tool) or {}).get("create_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise InvalidArgument(f"extra_info.tools_kwargs.{tool}.create_kwargs must be an object")
        return kwargs


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call, as an OpenAI function schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object)."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a model turn."""

    name: str
    """Empty when the call could not be parsed."""
    arguments_json: str
    """The arguments as a JSON object; the call's raw text when it could not be parsed."""


@dataclass(frozen=True)
class Action:
    """One model turn."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    """Parsed from text, in order; none = a final answer."""

    def size_bytes(self) -> int:
        return len(self.text.encode()) + sum(
            len(call.name.encode()) + len(call.arguments_json.encode()) for call in self.tool_calls)


@dataclass(frozen=True)
class Message:
    """One message of an observation."""

    role: str
    """"tool" for tool output, "user" or "system" for anything else."""
    content: str


@dataclass
class Session:
    """What Reset returns: the session's id, first observation and tools."""

    session_id: str
    observation: list[Message]
    tools: list[ToolSpec]


@dataclass
class StepResult:
    """What a Step returns."""

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    status: str = STEP_OK
    metrics: dict[str, float] = field(default_factory=dict)


def check_observation(observation: Any, max_bytes: int, who: str) -> None:
    """InvalidArgument unless `observation` is a list of Messages with known roles, max_bytes at most."""
    if not isinstance(observation, list) or not all(isinstance(m, Message) for m in observation):
        raise InvalidArgument(f"{who} returned an observation that is not a list of messages: {observation!r:.200}")
    size = 0
    for message in observation:
        if message.role not in MESSAGE_ROLES or not isinstance(message.content, str):
            raise InvalidArgument(f"{who} returned a message with role {message.role!r:.40} "
                                  f"(roles: {', '.join(MESSAGE_ROLES)}) or content that is not text")
        size += len(message.content.encode())
    if size > max_bytes:
        raise InvalidArgument(f"{who} returned an observation of {size} bytes; the limit is {max_bytes}")


def check_step_result(result: Any, max_observation_bytes: int, who: str) -> StepResult:
    """`result` when it keeps the contract (a StepResult, finite reward and metrics, a known status, a
    bounded observation); else InvalidArgument naming what `who` (e.g. "environment 'lookup'") got wrong."""
    if not isinstance(result, StepResult):
        raise InvalidArgument(f"{who} returned {type(result).__name__}, not a StepResult")
    check_observation(result.observation, max_observation_bytes, who)
    if not _finite(result.reward):
        raise InvalidArgument(f"{who} returned the reward {result.reward!r:.40}; it must be a finite number")
    if not isinstance(result.done, bool):
        raise InvalidArgument(f"{who} returned done={result.done!r:.40}; it must be true or false")
    if result.status not in STEP_STATUSES:
        raise InvalidArgument(f"{who} returned the step status {result.status!r:.40}; "
                              f"statuses: {', '.join(STEP_STATUSES)}")
    if not isinstance(result.metrics, dict):
        raise InvalidArgument(f"{who} returned metrics that are not a mapping")
    for name, value in result.metrics.items():
        if not isinstance(name, str) or not name or not _finite(value):
            raise InvalidArgument(f"{who} returned the metric {name!r:.60}={value!r:.40}; "
                                  "metrics are named finite numbers")
    return result


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
