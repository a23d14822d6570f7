"""The built-in environments in this process: the calculator's arithmetic and its bounds, the python
tool's confinement, the lookup toy task's episodes, and how ToolEnvironment turns bad calls into
observations with a status."""

from __future__ import annotations

import json
import os
import random
import time

import psutil
import pytest

from rlfabric.core.config import EnvConfig
from rlfabric.core.errors import InvalidArgument
from rlfabric.env import CalculatorEnvironment, LookupEnvironment, PythonEnvironment, ToolError
from rlfabric.env.calculator import calculator
from rlfabric.env.items import (
    STEP_INVALID_ARGUMENTS,
    STEP_OK,
    STEP_TOOL_ERROR,
    STEP_TOOL_TIMEOUT,
    STEP_UNKNOWN_TOOL,
    Action,
    Task,
    ToolCall,
)
from rlfabric.env.lookup import make_row


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments))


def turn(*calls: ToolCall, text: str = "") -> Action:
    return Action(text, tuple(calls))


@pytest.mark.parametrize(("expression", "value"), [
    ("6*7", "42"), ("(3 + 4) * 12", "84"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("-2 ** 3", "-8"),
    ("17 // 5 + 17 % 5", "5"), ("1.5 + 2", "3.5"), ("2 ** 64", str(2**64)),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "says"), [
    ("1/0", "division by zero"), ("10 ** 10 ** 10", "exponents above"), ("__import__('os')", "only numbers"),
    ("2 +", "not an arithmetic expression"), ("9" * 300, "longer than"), ("(-1) ** 0.5", "not real"),
    ("'a' * 3", "only numbers"), ("10 ** 60", "too large"),
])
def test_calculator_refuses_what_it_does_not_compute(expression, says):
    with pytest.raises(ToolError, match=says):
        calculator(expression)


def test_an_episode_of_tool_calls_then_a_final_answer():
    environment = CalculatorEnvironment(Task("calculator", ground_truth="84"), EnvConfig())
    assert environment.reset() == []
    assert [tool.name for tool in environment.tools] == ["calculator"]
    result = environment.step(turn(call("calculator", expression="(3 + 4) * 12"), call("calculator", expression="1+1")))
    assert [(m.role, m.content) for m in result.observation] == [("tool", "84"), ("tool", "2")]
    assert (result.status, result.done, result.reward) == (STEP_OK, False, 0.0)
    final = environment.step(turn(text="So the answer is #### 84"))
    assert (final.done, final.reward, final.observation) == (True, 1.0, [])
    assert final.metrics == {"tool_calls": 2.0}
    wrong = CalculatorEnvironment(Task("calculator", ground_truth="84"), EnvConfig())
    assert wrong.step(turn(text="#### 85")).reward == 0.0


@pytest.mark.parametrize(("bad_call", "status", "says"), [
    (ToolCall("calculate", '{"expression": "1"}'), STEP_UNKNOWN_TOOL, "unknown tool 'calculate'; tools: calculator"),
    (ToolCall("calculator", '{"expression": '), STEP_INVALID_ARGUMENTS, "are not JSON"),
    (ToolCall("calculator", '["1+1"]'), STEP_INVALID_ARGUMENTS, "must be a JSON object"),
    (ToolCall("calculator", '{"expr": "1"}'), STEP_INVALID_ARGUMENTS, "unknown argument 'expr'"),
    (ToolCall("calculator", "{}"), STEP_INVALID_ARGUMENTS, "missing argument 'expression'"),
    (ToolCall("calculator", '{"expression": 12}'), STEP_INVALID_ARGUMENTS, "must be of type string"),
    (ToolCall("", '<tool_call>{"name": calc'), STEP_INVALID_ARGUMENTS, "could not be parsed"),
    (ToolCall("calculator", '{"expression": "1/0"}'), STEP_TOOL_ERROR, "division by zero"),
])
def test_a_bad_call_is_an_observation_with_its_status(bad_call, status, says):
    environment = CalculatorEnvironment(Task("calculator"), EnvConfig())
    result = environment.step(turn(call("calculator", expression="2+2"), bad_call))
    assert result.status == status and not result.done
    assert result.observation[0].content == "4"  # the good call before it still ran
    assert result.observation[1].role == "tool" and says in result.observation[1].content


def test_a_tool_that_raises_anything_is_a_tool_error_the_model_reads():
    environment = LookupEnvironment(Task("lookup"), EnvConfig())
    environment.lookup = None  # not callable: a TypeError inside the tool
    environment._tools["lookup"] = type(environment._tools["lookup"])(environment.tools[0], lambda key: 1 / 0)
    result = environment.step(turn(call("lookup", key="a")))
    assert result.status == STEP_TOOL_ERROR
    assert "ZeroDivisionError" in result.observation[0].content


def test_lookup_answer_needs_the_tool():
    row = make_row(random.Random(3))
    task = Task("lookup", row["prompt"][0]["content"], row["reward_model"]["ground_truth"], row["extra_info"])
    key = next(iter(row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["table"]))
    assert f"key {key} " in task.prompt
    environment = LookupEnvironment(task, EnvConfig())
    looked_up = environment.step(turn(call("lookup", key=key)))
    assert looked_up.observation[0].content == task.ground_truth
    missing = environment.step(turn(call("lookup", key="no such")))
    assert (missing.status, missing.observation[0].content) == (STEP_TOOL_ERROR, "error: no key 'no such'")
    assert environment.step(turn(text=f"#### {looked_up.observation[0].content}")).reward == 1.0


def test_lookup_rows_differ_and_a_bad_table_is_refused():
    rows = [make_row(random.Random(seed)) for seed in range(20)]
    assert len({row["reward_model"]["ground_truth"] for row in rows}) > 3
    with pytest.raises(InvalidArgument, match="table must be an object"):
        LookupEnvironment(Task("lookup", extra_info={"tools_kwargs": {"lookup": {"create_kwargs": {"table": [1]}}}}),
                          EnvConfig())


# --- python: confined code execution ---


def python_environment(**python) -> PythonEnvironment:
    return PythonEnvironment(Task("python", ground_truth="1024"), EnvConfig(python=python))


def run_code(environment: PythonEnvironment, code: str):
    return environment.step(turn(call("python", code=code)))


def test_python_runs_code_and_returns_what_it_prints():
    environment = python_environment()
    result = run_code(environment, "import math\nprint(2 ** 10, math.isqrt(17))")
    assert (result.status, result.observation[0].content) == (STEP_OK, "1024 4\n")
    assert environment.step(turn(text="#### 1024")).reward == 1.0


def test_python_error_shows_the_code_traceback_only():
    result = run_code(python_environment(), "x = 1\nraise ValueError('bad value')")
    assert result.status == STEP_TOOL_ERROR
    output = result.observation[0].content
    assert 'File "<code>", line 2' in output and "ValueError: bad value" in output
    assert "python_runner" not in output


def test_python_code_past_its_timeout_is_killed_with_what_it_spawned():
    # A forked child in a session of its own (a daemon) dies with the code.
    code = ("import os, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "print('child', pid, flush=True)\nwhile True: pass")
    result = run_code(python_environment(timeout_s=0.8), code)
    assert result.status == STEP_TOOL_TIMEOUT
    output = result.observation[0].content
    assert "ran past 0.8 s" in output
    child = int(output.split("child ")[1].split()[0])
    assert not _running(child)


@pytest.mark.skipif(os.geteuid() != 0, reason="the code runs as a uid of its own only under root")
def test_code_whose_runner_starts_after_the_deadline_is_killed_too():
    # A deadline shorter than the supervisor's start: it forks the runner only once the call has timed out.
    started = time.time()
    result = run_code(python_environment(timeout_s=0.01), "while True: pass")
    assert result.status == STEP_TOOL_TIMEOUT
    orphans = [p for p in psutil.process_iter(["cmdline", "create_time", "uids"])
               if "rlfabric.env.python_runner" in " ".join(p.info["cmdline"] or []) and p.info["uids"].real != 0
               and p.info["create_time"] >= started - 1 and _running(p.pid) and not _is_runner(p.parent())]
    assert not orphans, [(p.pid, p.info) for p in orphans]


def _is_runner(process: psutil.Process | None) -> bool:
    """Whether `process` is a supervisor or runner of the python tool (a live code process's parent is one)."""
    try:
        return process is not None and "rlfabric.env.python_runner" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_python_output_is_cut_off_at_the_limit():
    result = run_code(python_environment(max_output_bytes=1000), "while True: print('y' * 100)")
    assert result.status == STEP_OK
    output = result.observation[0].content
    kept, note = output.rsplit("\n", 1)
    assert note == "[output cut off at 1000 bytes]"
    assert len(kept.encode()) == 1000 and set(kept) == {"y", "\n"}


def test_python_code_has_no_network():
    code = "import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)"
    result = run_code(python_environment(), code)
    assert result.status == STEP_TOOL_ERROR
    assert "Network is unreachable" in result.observation[0].content or "sandbox" in result.observation[0].content
