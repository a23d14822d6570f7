"""What a client accepts from an environment service in any language: answers that break the contract
are InvalidArgument naming the service, before any caller sees them."""

from __future__ import annotations

import math

import pytest

from rlfabric.core.errors import InvalidArgument
from rlfabric.env import wire
from rlfabric.env.items import (
    STEP_TOOL_TIMEOUT,
    Action,
    Message,
    Session,
    StepResult,
    Task,
    ToolCall,
    ToolSpec,
)
from rlfabric.v1 import common_pb2, environment_pb2

WHO = "the environment service at 127.0.0.1:1"


def test_requests_and_answers_round_trip():
    task = Task("lookup", "p", "7", {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"q": 7}}}}})
    assert wire.task_from_request(wire.reset_request(task)) == task
    action = Action("t", (ToolCall("lookup", '{"key": "q"}'), ToolCall("", "raw")))
    assert wire.action_from_request(wire.step_request("s", action)) == action
    session = Session("s1", [Message("user", "hi")], [ToolSpec("lookup", "d", {"type": "object"})])
    assert wire.session_from_response(wire.reset_response(session), WHO) == session
    result = StepResult([Message("tool", "7")], 0.5, True, STEP_TOOL_TIMEOUT, {"calls": 2.0})
    assert wire.step_from_response(wire.step_response(result), WHO) == result


def reset_answer(**fields) -> environment_pb2.EnvironmentServiceResetResponse:
    return environment_pb2.EnvironmentServiceResetResponse(**{"session_id": "s1", **fields})


@pytest.mark.parametrize(("answer", "says"), [
    (reset_answer(session_id=""), "without a session id"),
    (reset_answer(tools=[environment_pb2.ToolSpec(name="t", parameters_json="{no")]), "not JSON"),
    (reset_answer(tools=[environment_pb2.ToolSpec(name="t", parameters_json="[1]")]), "not an object"),
    (reset_answer(tools=[environment_pb2.ToolSpec(parameters_json="{}")]), "without a name"),
    (reset_answer(observation=environment_pb2.Observation(
        messages=[common_pb2.ChatMessage(role="assistant", content="x")])), "role 'assistant'"),
])
def test_a_reset_answer_out_of_contract_is_invalid_argument(answer, says):
    with pytest.raises(InvalidArgument, match=says) as info:
        wire.session_from_response(answer, WHO)
    assert WHO in str(info.value)


@pytest.mark.parametrize(("answer", "says"), [
    (environment_pb2.EnvironmentServiceStepResponse(status=0), "status 0 .STEP_STATUS_UNSPECIFIED."),
    (environment_pb2.EnvironmentServiceStepResponse(status=99), "status 99 .unknown."),
    (environment_pb2.EnvironmentServiceStepResponse(status=1, reward=math.inf), "reward inf"),
    (environment_pb2.EnvironmentServiceStepResponse(status=1, metrics={"x": math.nan}), "metric 'x'=nan"),
])
def test_a_step_answer_out_of_contract_is_invalid_argument(answer, says):
    with pytest.raises(InvalidArgument, match=says):
        wire.step_from_response(answer, WHO)
