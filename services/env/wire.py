"""Domain objects <-> EnvironmentService messages, both ways (the servicer and the clients use them).
What comes from an environment over the wire is checked against the contract here, as the service
checks its Python environments (items.check_step_result), so a broken environment in any language is
InvalidArgument for the caller."""

from __future__ import annotations

import json

from rlfabric.core.errors import InvalidArgument
from rlfabric.env.items import (
    STEP_INVALID_ARGUMENTS,
    STEP_OK,
    STEP_TOOL_ERROR,
    STEP_TOOL_TIMEOUT,
    STEP_UNKNOWN_TOOL,
    Action,
    Message,
    Session,
    StepResult,
    Task,
    ToolCall,
    ToolSpec,
    check_observation,
    check_step_result,
)
from rlfabric.v1 import common_pb2, environment_pb2

_STATUS_TO_WIRE = {
    STEP_OK: environment_pb2.STEP_STATUS_OK,
    STEP_UNKNOWN_TOOL: environment_pb2.STEP_STATUS_UNKNOWN_TOOL,
    STEP_INVALID_ARGUMENTS: environment_pb2.STEP_STATUS_INVALID_ARGUMENTS,
    STEP_TOOL_ERROR: environment_pb2.STEP_STATUS_TOOL_ERROR,
    STEP_TOOL_TIMEOUT: environment_pb2.STEP_STATUS_TOOL_TIMEOUT,
}
_STATUS_FROM_WIRE = {wire: status for status, wire in _STATUS_TO_WIRE.items()}
# What a client accepts from a remote environment: the contract's limit, not the service's own config.
MAX_OBSERVATION_BYTES = 16 * 1024 * 1024


# --- the caller's side: requests out, answers in ---

def reset_request(task: Task) -> environment_pb2.EnvironmentServiceResetRequest:
    return environment_pb2.EnvironmentServiceResetRequest(task=environment_pb2.Task(
        environment=task.environment, prompt=task.prompt, ground_truth=task.ground_truth,
        extra_info_json=json.dumps(task.extra_info) if task.extra_info else ""))


def step_request(session_id: str, action: Action) -> environment_pb2.EnvironmentServiceStepRequest:
    return environment_pb2.EnvironmentServiceStepRequest(session_id=session_id, action=environment_pb2.Action(
        text=action.text,
        tool_calls=[environment_pb2.ToolCall(name=c.name, arguments_json=c.arguments_json) for c in action.tool_calls]))


def session_from_response(response: environment_pb2.EnvironmentServiceResetResponse, who: str) -> Session:
    """The Session of an EnvironmentServiceResetResponse; InvalidArgument when `who` answered out of contract."""
    if not response.session_id:
        raise InvalidArgument(f"{who} answered Reset without a session id")
    observation = _messages(response.observation)
    check_observation(observation, MAX_OBSERVATION_BYTES, who)
    tools = []
    for tool in response.tools:
        try:
            parameters = json.loads(tool.parameters_json or "{}")
        except ValueError:
            raise InvalidArgument(f"{who} declared tool {tool.name!r:.60} with parameters that are not JSON") from None
        if not tool.name or not isinstance(parameters, dict):
            raise InvalidArgument(f"{who} declared a tool without a name or with parameters that are not an object")
        tools.append(ToolSpec(tool.name, tool.description, parameters))
    return Session(response.session_id, observation, tools)


def step_from_response(response: environment_pb2.EnvironmentServiceStepResponse, who: str) -> StepResult:
    """The StepResult of an EnvironmentServiceStepResponse; InvalidArgument when `who` answered out of contract."""
    if response.status not in _STATUS_FROM_WIRE:
        raise InvalidArgument(f"{who} answered Step with the status {response.status} "
                              f"({environment_pb2.StepStatus.Name(response.status) if response.status in environment_pb2.StepStatus.values() else 'unknown'})")
    result = StepResult(_messages(response.observation), response.reward, response.done,
                        _STATUS_FROM_WIRE[response.status], dict(response.metrics))
    return check_step_result(result, MAX_OBSERVATION_BYTES, who)


# --- the service's side: requests in, answers out ---

def task_from_request(request: environment_pb2.EnvironmentServiceResetRequest) -> Task:
    task = request.task
    extra_info = {}
    if task.extra_info_json:
        try:
            extra_info = json.loads(task.extra_info_json)
        except ValueError as error:
            raise InvalidArgument(f"task.extra_info_json is not JSON: {error}") from None
        if not isinstance(extra_info, dict):
            raise InvalidArgument("task.extra_info_json must be a JSON object")
    return Task(task.environment, task.prompt, task.ground_truth, extra_info)


def action_from_request(request: environment_pb2.EnvironmentServiceStepRequest) -> Action:
    action = request.action
    return Action(action.text, tuple(ToolCall(c.name, c.arguments_json) for c in action.tool_calls))


def reset_response(session: Session) -> environment_pb2.EnvironmentServiceResetResponse:
    return environment_pb2.EnvironmentServiceResetResponse(
        session_id=session.session_id, observation=_observation(session.observation),
        tools=[environment_pb2.ToolSpec(name=t.name, description=t.description, parameters_json=json.dumps(t.parameters))
               for t in session.tools])


def step_response(result: StepResult) -> environment_pb2.EnvironmentServiceStepResponse:
    return environment_pb2.EnvironmentServiceStepResponse(observation=_observation(result.observation),
                                                          reward=result.reward, done=result.done,
                                                          status=_STATUS_TO_WIRE[result.status], metrics=result.metrics)


def _observation(messages: list[Message]) -> environment_pb2.Observation:
    return environment_pb2.Observation(messages=[common_pb2.ChatMessage(role=m.role, content=m.content)
                                                 for m in messages])


def _messages(observation: environment_pb2.Observation) -> list[Message]:
    return [Message(m.role, m.content) for m in observation.messages]
