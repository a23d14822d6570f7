"""What an environment is in Python, the registry of environments by name, and ToolEnvironment, the
base of environments whose turns are tool calls (every built-in one).

    class Dice(ToolEnvironment):
        def __init__(self, task, config):
            super().__init__(task, [Tool(ROLL_SPEC, self.roll)])
        def roll(self, sides: int) -> str:
            return str(random.randint(1, sides))

    register_environment("dice", Dice)

The service makes one environment object per session (factory(task, config)), calls reset() once,
step() once per model turn (never two at once for one session), close() at the end; each of them on
a thread, so a blocking environment never stalls the service.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlfabric.core.errors import InvalidArgument
from rlfabric.env.items import (
    STEP_INVALID_ARGUMENTS,
    STEP_OK,
    STEP_TOOL_ERROR,
    STEP_TOOL_TIMEOUT,
    STEP_UNKNOWN_TOOL,
    Action,
    Message,
    StepResult,
    Task,
    ToolCall,
    ToolSpec,
)
from rlfabric.reward.gsm8k import compute_score as gsm8k_score

if TYPE_CHECKING:
    from rlfabric.core.config import EnvConfig

MAX_ERROR_CHARS = 500  # of a tool's error message, in the observation the model reads


class Environment(ABC):
    """One session's environment."""

    tools: list[ToolSpec] = []
    """Tools the model may call."""

    @abstractmethod
    def reset(self) -> list[Message]:
        """The first observation (may be empty)."""

    @abstractmethod
    def step(self, action: Action) -> StepResult:
        """Applies one model turn."""

    def close(self) -> None:
        """Frees what the session holds (called once, also when the session idled out)."""
        return None  # most environments hold nothing


EnvironmentFactory = Callable[[Task, "EnvConfig"], Environment]
_ENVIRONMENTS: dict[str, EnvironmentFactory] = {}


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Makes `name` an environment tasks can name; a second registration of a name replaces the first."""
    if not name:
        raise ValueError("an environment needs a name")
    _ENVIRONMENTS[name] = factory


def environment_factory(name: str) -> EnvironmentFactory:
    """The factory registered as `name`; InvalidArgument naming the registered ones otherwise."""
    factory = _ENVIRONMENTS.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown environment {name!r}; registered: {', '.join(registered_environments())} "
                              "(env.environment_modules imports modules that register more)")
    return factory


def registered_environments() -> list[str]:
    return sorted(_ENVIRONMENTS)


class ToolError(Exception):
    """A tool failed in a way the model should read (its message becomes the tool's output)."""


class ToolTimeout(ToolError):
    """A tool ran past its own time limit."""


@dataclass(frozen=True)
class Tool:
    """A tool of a ToolEnvironment: its schema and the function that runs it, called with the call's
    arguments as keyword arguments; it returns the text the model reads."""

    spec: ToolSpec
    run: Callable[..., str]


class ToolEnvironment(Environment):
    """An environment whose turns are tool calls. A turn with tool calls runs each and answers with one
    "tool" message per call; a turn without is the final answer, which ends the episode with reward 1
    when its "#### ANSWER" equals the task's ground truth (GSM8K strict), else 0.

    A bad call is an observation, not an error: an unknown tool, arguments that are not a JSON object
    or that the tool does not take, a ToolTimeout, a ToolError or any other exception of the tool
    become the tool's output, and the step's status names the first kind that happened.
    """

    def __init__(self, task: Task, tools: list[Tool], first_observation: list[Message] | None = None):
        self.task = task
        self._tools = {tool.spec.name: tool for tool in tools}
        self.tools = [tool.spec for tool in tools]
        self._first_observation = first_observation or []
        self.tool_calls = 0

    def reset(self) -> list[Message]:
        return list(self._first_observation)

    def step(self, action: Action) -> StepResult:
        if not action.tool_calls:
            return StepResult(reward=self.final_reward(action.text), done=True,
                              metrics={"tool_calls": float(self.tool_calls)})
        observation, statuses = [], []
        for call in action.tool_calls:
            status, output = self.run_tool(call)
            observation.append(Message("tool", output))
            statuses.append(status)
        self.tool_calls += len(action.tool_calls)
        failed = [status for status in statuses if status != STEP_OK]
        return StepResult(observation=observation, status=failed[0] if failed else STEP_OK)

    def final_reward(self, text: str) -> float:
        """The reward of the final answer (override for other tasks)."""
        return gsm8k_score(text, self.task.ground_truth.strip()) if self.task.ground_truth else 0.0

    def run_tool(self, call: ToolCall) -> tuple[str, str]:
        """(status, output) of one call."""
        tool = self._tools.get(call.name)
        if not call.name:
            return STEP_INVALID_ARGUMENTS, f"error: the tool call could not be parsed: {call.arguments_json[:200]}"
        if tool is None:
            return STEP_UNKNOWN_TOOL, f"error: unknown tool {call.name!r}; tools: {', '.join(self._tools)}"
        try:
            arguments = json.loads(call.arguments_json or "{}")
        except ValueError as error:
            return STEP_INVALID_ARGUMENTS, f"error: the arguments of {call.name} are not JSON: {error}"
        if not isinstance(arguments, dict):
            return STEP_INVALID_ARGUMENTS, f"error: the arguments of {call.name} must be a JSON object"
        missing = check_arguments(tool.spec, arguments)
        if missing:
            return STEP_INVALID_ARGUMENTS, f"error: {call.name}: {missing}"
        try:
            return STEP_OK, tool.run(**arguments)
        except ToolTimeout as error:
            return STEP_TOOL_TIMEOUT, f"error: {call.name} timed out: {error}"[:MAX_ERROR_CHARS]
        except ToolError as error:
            return STEP_TOOL_ERROR, f"error: {error}"[:MAX_ERROR_CHARS]
        except Exception as error:  # a bug in the tool: the model reads it as any tool failure
            return STEP_TOOL_ERROR, f"error: {call.name} failed: {type(error).__name__}: {error}"[:MAX_ERROR_CHARS]


def check_arguments(spec: ToolSpec, arguments: dict[str, Any]) -> str:
    """What is wrong with `arguments` for the tool ('' when nothing): unknown or missing names, or a
    value of the wrong JSON type (the schema's top-level properties and required list only)."""
    properties = spec.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return f"unknown argument {unknown[0]!r}; arguments: {', '.join(properties)}"
    missing = [name for name in spec.parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument {missing[0]!r}"
    for name, value in arguments.items():
        expected = properties[name].get("type")
        if expected and not isinstance(value, _JSON_TYPES.get(expected, object)) or (
                expected in ("integer", "number") and isinstance(value, bool)):
            return f"argument {name!r} must be of type {expected}, got {json.dumps(value)[:60]}"
    return ""


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
