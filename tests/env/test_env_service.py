"""EnvironmentService on a real loopback server, through both client kinds: sessions from Reset to
Close, and every failure mode with its status (unknown or idled-out session NOT_FOUND, a slow
environment DEADLINE_EXCEEDED, garbage INVALID_ARGUMENT, too much RESOURCE_EXHAUSTED), after each of
which the service keeps serving."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import grpc
import pytest

from rlfabric.core.config import EnvConfig
from rlfabric.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from rlfabric.env import Environment, register_environment
from rlfabric.env.client import EnvClient
from rlfabric.env.engine import EnvEngine
from rlfabric.env.items import STEP_OK, STEP_UNKNOWN_TOOL, Action, Message, StepResult, Task, ToolCall
from rlfabric.v1 import environment_pb2, environment_pb2_grpc
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

SIX_BY_SEVEN = Action("", (ToolCall("calculator", '{"expression": "6*7"}'),))
release_blocked_steps = threading.Event()  # set at each test's end: no step thread outlives its test


class Blocking(Environment):
    """A Step that waits until the test releases it (or 10 s)."""

    def reset(self):
        return []

    def step(self, action):
        release_blocked_steps.wait(10)
        return StepResult()


GARBAGE = {
    "nan reward": StepResult(reward=math.nan),
    "unknown status": StepResult(status="fine"),
    "assistant message": StepResult(observation=[Message("assistant", "I am the model")]),
    "not a message": StepResult(observation=["text"]),
    "infinite metric": StepResult(metrics={"x": math.inf}),
    "huge observation": StepResult(observation=[Message("tool", "z" * 5000)]),
    "not a step result": {"reward": 1.0},
}


class Garbage(Environment):
    """Answers its Step with the GARBAGE entry its task's prompt names."""

    def __init__(self, task, config):
        self.answer = GARBAGE[task.prompt]

    def reset(self):
        return []

    def step(self, action):
        return self.answer


class Raising(Environment):
    def reset(self):
        return [Message("user", "go")]

    def step(self, action):
        raise RuntimeError("the environment broke")


register_environment("blocking", lambda task, config: Blocking())
register_environment("garbage", Garbage)
register_environment("raising", lambda task, config: Raising())


@pytest.fixture(autouse=True)
def release_blocked_steps_at_the_end():
    release_blocked_steps.clear()
    yield
    release_blocked_steps.set()


def assert_still_serving(server) -> None:
    session = server.reset(Task("calculator"))
    assert server.step(session.session_id, SIX_BY_SEVEN).observation[0].content == "42"
    server.close_session(session.session_id)


# --- sessions ---


def test_a_session_from_reset_to_close(env_server):
    server = env_server()
    session = server.reset(Task("calculator", prompt="What is 6*7?", ground_truth="42"))
    assert session.session_id and session.observation == []
    assert [tool.name for tool in session.tools] == ["calculator"]
    assert session.tools[0].parameters["required"] == ["expression"]
    result = server.step(session.session_id, SIX_BY_SEVEN)
    assert ([(m.role, m.content) for m in result.observation], result.status, result.done) == (
        [("tool", "42")], STEP_OK, False)
    final = server.step(session.session_id, Action("#### 42"))
    assert (final.done, final.reward, final.metrics) == (True, 1.0, {"tool_calls": 1.0})
    status = server.status()
    assert (status.sessions_open, status.sessions_started, status.steps) == (1, 1, 2)
    assert {"calculator", "python", "lookup"} <= set(status.environments)
    server.close_session(session.session_id)
    assert server.status().sessions_open == 0
    assert server.metric("rlfabric_env_steps_total", status="ok") == 2
    assert server.metric("rlfabric_env_sessions_total") == 1


def test_the_default_environment_takes_a_task_that_names_none(env_server):
    server = env_server(name="lookup")
    session = server.reset(Task(extra_info={"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"k": 3}}}}}))
    assert [tool.name for tool in session.tools] == ["lookup"]
    assert server.step(session.session_id, Action("", (ToolCall("lookup", '{"key": "k"}'),))).observation[0].content == "3"


def test_a_bad_tool_call_is_an_observation_and_a_counted_status(env_server):
    server = env_server()
    session = server.reset(Task("calculator"))
    result = server.step(session.session_id, Action("", (ToolCall("calc", "{}"),)))
    assert result.status == STEP_UNKNOWN_TOOL and "unknown tool 'calc'" in result.observation[0].content
    assert server.metric("rlfabric_env_steps_total", status="unknown_tool") == 1
    assert server.step(session.session_id, SIX_BY_SEVEN).status == STEP_OK  # the session goes on


def test_sessions_run_concurrently(grpc_env_server):
    server = grpc_env_server()
    count = 16

    async def episode(client, index: int) -> str:
        session = await client.reset(Task("calculator"))
        result = await client.step(session.session_id, Action("", (ToolCall("calculator", f'{{"expression": "{index}*2"}}'),)))
        await client.close_session(session.session_id)
        return result.observation[0].content

    async def episodes():
        async with EnvClient(server.address) as client:
            return await asyncio.gather(*(episode(client, index) for index in range(count)))

    assert asyncio.run(episodes()) == [str(index * 2) for index in range(count)]


def test_more_sessions_step_at_once_than_the_default_thread_pool_holds(grpc_env_server):
    count = 12  # asyncio's default pool has min(32, cores + 4) threads: 6 on two cores
    meeting = threading.Barrier(count, timeout=10)  # passes only when every Step runs at once

    class Meeting(Environment):
        def reset(self):
            return []

        def step(self, action):
            meeting.wait()
            return StepResult(done=True)

    register_environment("meeting", lambda task, config: Meeting())
    server = grpc_env_server()

    async def steps():
        async with EnvClient(server.address) as client:
            sessions = [await client.reset(Task("meeting")) for _ in range(count)]
            return await asyncio.gather(*(client.step(s.session_id, Action("hi")) for s in sessions))

    assert [result.done for result in asyncio.run(steps())] == [True] * count


# --- failures: unknown, finished, busy and idle sessions ---


def test_an_unknown_session_is_not_found(env_server):
    server = env_server()
    with pytest.raises(NotFound, match="no session 'nope'"):
        server.step("nope", SIX_BY_SEVEN)
    with pytest.raises(NotFound):
        server.close_session("nope")
    assert_still_serving(server)


def test_a_closed_session_is_not_found_and_says_why(env_server):
    server = env_server()
    session = server.reset(Task("calculator"))
    server.close_session(session.session_id)
    with pytest.raises(NotFound, match="was closed: it was closed by a Close call"):
        server.step(session.session_id, SIX_BY_SEVEN)
    with pytest.raises(NotFound):
        server.close_session(session.session_id)


def test_a_step_after_done_or_past_the_step_limit_is_refused(env_server):
    server = env_server(max_steps_per_session=2)
    done = server.reset(Task("calculator"))
    assert server.step(done.session_id, Action("#### 1")).done
    with pytest.raises(FailedPrecondition, match="is done"):
        server.step(done.session_id, SIX_BY_SEVEN)
    busy = server.reset(Task("calculator"))
    server.step(busy.session_id, SIX_BY_SEVEN)
    server.step(busy.session_id, SIX_BY_SEVEN)
    with pytest.raises(FailedPrecondition, match="took 2 steps"):
        server.step(busy.session_id, SIX_BY_SEVEN)


def test_a_session_that_idles_past_its_timeout_is_closed(env_server):
    server = env_server(session_idle_timeout_s=0.3)
    session = server.reset(Task("calculator"))
    wait_until(lambda: server.status().sessions_expired == 1, 10, "the idle session to be closed")
    assert server.status().sessions_open == 0
    with pytest.raises(NotFound, match="idled past env.session_idle_timeout_s=0.3 s"):
        server.step(session.session_id, SIX_BY_SEVEN)
    assert server.metric("rlfabric_env_sessions_expired_total") == 1
    assert_still_serving(server)


def test_only_sessions_idle_past_the_timeout_are_closed():
    """With a clock the test moves: a call keeps a session alive, a running Step is never reaped."""
    now = [0.0]
    engine = EnvEngine(EnvConfig(session_idle_timeout_s=10), clock=lambda: now[0])

    async def scenario():
        await engine.start()
        idle = await engine.reset(Task("calculator"))
        used = await engine.reset(Task("calculator"))
        now[0] = 8.0
        await engine.step(used.session_id, SIX_BY_SEVEN)
        now[0] = 11.0
        assert await engine.close_idle_sessions() == 1
        assert list(engine.sessions) == [used.session_id]
        engine.sessions[used.session_id].busy = True
        now[0] = 100.0
        assert await engine.close_idle_sessions() == 0
        await engine.stop()
        assert idle.session_id not in engine.sessions and engine.sessions == {}

    asyncio.run(scenario())


def test_a_second_step_while_one_runs_is_refused(grpc_env_server):
    server = grpc_env_server()
    session = server.reset(Task("blocking"))

    async def two_steps():
        async with EnvClient(server.address) as client:
            first = asyncio.ensure_future(client.step(session.session_id, Action("a")))
            await asyncio.sleep(0)
            while not server.engine.sessions[session.session_id].busy:
                await asyncio.sleep(0.01)  # (no event to wait on in another thread's engine)
            with pytest.raises(FailedPrecondition, match="running a Step already"):
                await client.step(session.session_id, Action("b"))
            release_blocked_steps.set()
            return await first

    assert asyncio.run(two_steps()).status == STEP_OK


# --- failures: deadlines ---


def test_a_step_past_the_step_timeout_is_deadline_exceeded_and_closes_the_session(env_server):
    server = env_server(step_timeout_s=0.3)
    session = server.reset(Task("blocking"))
    with pytest.raises(DeadlineExceeded, match="ran past env.step_timeout_s=0.3 s"):
        server.step(session.session_id, Action("hello"))
    with pytest.raises(NotFound, match="its Step failed"):
        server.step(session.session_id, Action("hello"))
    assert_still_serving(server)


def test_a_caller_deadline_ends_the_call_and_the_session_not_the_service(grpc_env_server):
    server = grpc_env_server()
    session = server.reset(Task("blocking"))
    with pytest.raises(DeadlineExceeded, match=r"env at 127\.0\.0\.1:\d+ \(Step, deadline 0\.3 s\)"):
        server.step(session.session_id, Action("hello"), timeout_s=0.3)
    wait_until(lambda: server.status().sessions_open == 0, 10, "the abandoned session to be closed")
    assert_still_serving(server)


# --- failures: bad input, garbage, limits ---


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_an_environment_answering_garbage_is_invalid_argument(env_server, kind):
    server = env_server(max_observation_bytes=4096)
    session = server.reset(Task("garbage", prompt=kind))
    with pytest.raises(InvalidArgument, match="environment 'garbage' returned"):
        server.step(session.session_id, Action("hello"))
    with pytest.raises(NotFound):  # the session ended with it
        server.step(session.session_id, Action("hello"))
    assert_still_serving(server)


def test_an_environment_that_raises_is_internal(env_server):
    server = env_server()
    session = server.reset(Task("raising"))
    assert session.observation == [Message("user", "go")]
    with pytest.raises(Internal, match="environment 'raising' failed in Step: RuntimeError: the environment broke"):
        server.step(session.session_id, Action("hello"))
    assert_still_serving(server)


def test_an_oversized_action_is_resource_exhausted_and_the_session_goes_on(env_server):
    server = env_server(max_action_bytes=100, max_tool_calls_per_step=2)
    session = server.reset(Task("calculator"))
    with pytest.raises(ResourceExhausted, match="101 bytes; the limit is env.max_action_bytes=100"):
        server.step(session.session_id, Action("x" * 101))
    with pytest.raises(ResourceExhausted, match="3 tool calls"):
        server.step(session.session_id, Action("", SIX_BY_SEVEN.tool_calls * 3))
    assert server.step(session.session_id, SIX_BY_SEVEN).observation[0].content == "42"


def test_sessions_past_the_limit_are_resource_exhausted(env_server):
    server = env_server(max_sessions=2)
    first, _ = server.reset(Task("calculator")), server.reset(Task("calculator"))
    with pytest.raises(ResourceExhausted, match="2 sessions are open"):
        server.reset(Task("calculator"))
    server.close_session(first.session_id)
    server.reset(Task("calculator"))


def test_an_unknown_environment_or_bad_task_is_invalid_argument(env_server):
    server = env_server()
    with pytest.raises(InvalidArgument, match=r"unknown environment 'chess'; registered: .*calculator"):
        server.reset(Task("chess"))
    with pytest.raises(InvalidArgument, match="table must be an object"):
        server.reset(Task("lookup", extra_info={"tools_kwargs": {"lookup": {"create_kwargs": {"table": 3}}}}))
    assert server.status().sessions_open == 0
    assert_still_serving(server)


def test_extra_info_that_is_not_a_json_object_is_invalid_argument(grpc_env_server):
    server = grpc_env_server()
    with grpc.insecure_channel(server.address) as channel:
        stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
        for bad in ("{not json", json.dumps([1, 2])):
            with pytest.raises(grpc.RpcError) as info:
                task = environment_pb2.Task(extra_info_json=bad)
                stub.Reset(environment_pb2.EnvironmentServiceResetRequest(task=task), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "extra_info_json" in info.value.details()
