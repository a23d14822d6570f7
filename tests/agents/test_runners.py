"""What an agent returns (outcome.py), how an entrypoint loads, and the runners' processes: real subprocesses,
no model (the runs are tests/coordinator/test_agent_episodes.py)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from rlfabric.agents import runners
from rlfabric.agents.entrypoint import load_entrypoint
from rlfabric.agents.llm import LLM
from rlfabric.agents.outcome import AgentFailed, AgentOutcome, parse_outcome
from rlfabric.agents.runners import InlineRunner, ProcessRunner, runner_of
from rlfabric.core.config import AgentConfig, ConfigError, load_config

LLM_HERE = LLM("http://127.0.0.1:9/v1", "rlf-ep-test", "policy")


async def one_episode(runner, task: dict) -> AgentOutcome:
    """An episode of a fresh runner, closed after (a warm runner's host with it)."""
    try:
        return await runner.run(task, LLM_HERE)
    finally:
        await runner.close()


@pytest.mark.parametrize("value, outcome", [
    (0.5, AgentOutcome(reward=0.5)),
    (1, AgentOutcome(reward=1.0)),
    ("#### 7", AgentOutcome(answer="#### 7")),
    ({"reward": 1, "metrics": {"turns": 2}}, AgentOutcome(reward=1.0, metrics={"turns": 2.0})),
    ({"answer": "#### 3"}, AgentOutcome(answer="#### 3")),
])
def test_an_agent_returns_a_reward_an_answer_or_a_dict_of_them(value, outcome):
    assert parse_outcome(value) == outcome


@pytest.mark.parametrize("value, says", [
    (None, "returned None"), (True, "returned True"), ([1], "returned \\[1\\]"), ({"score": 1}, "neither"),
    ({"reward": "high"}, "not a number"), ({"answer": 7}, "not a string"), (float("nan"), "not a finite"),
    ({"reward": 1, "metrics": {"x": "y"}}, "metrics"),
])
def test_anything_else_is_garbage(value, says):
    with pytest.raises(AgentFailed, match=says) as failure:
        parse_outcome(value)
    assert failure.value.reason == "garbage"


def test_an_entrypoint_that_cannot_run_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "sync_agent.py").write_text("def run(task, llm):\n    return 1.0\n")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    for entrypoint, says in [("agent.py", "write path/to/agent.py:run"), (f"{tmp_path}/none.py:run", "no file"),
                             (f"{tmp_path}/sync_agent.py:run", "async def run"),
                             (f"{tmp_path}/broken.py:run", "importing .* failed: ModuleNotFoundError"),
                             ("no_such_package_xyz.agent:run", "no module")]:
        with pytest.raises(ConfigError, match=f"agent.entrypoint .*{says}"):
            load_entrypoint(entrypoint)


def test_two_agent_files_of_one_name_load_apart(tmp_path):
    for folder, reward in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "agent.py").write_text(f"async def run(task, llm):\n    return {reward}\n")
    runs = [load_entrypoint(f"{tmp_path / folder / 'agent.py'}:run") for folder in "ab"]
    assert [asyncio.run(run({}, LLM_HERE)) for run in runs] == [1.0, 2.0]


def test_an_inline_agent_that_raises_fails_its_episode(tmp_path):
    (tmp_path / "agent.py").write_text("async def run(task, llm):\n    raise KeyError('tools')\n")
    with pytest.raises(AgentFailed, match="raised: KeyError") as failure:
        asyncio.run(InlineRunner(f"{tmp_path}/agent.py:run").run({}, LLM_HERE))
    assert failure.value.reason == "raised"


@pytest.mark.parametrize("preload", [True, False], ids=["warm", "cold"])
def test_a_subprocess_agent_gets_the_task_and_the_openai_variables_and_its_prints_are_not_its_result(tmp_path,
                                                                                                     preload):
    tmp_path.chmod(0o755)  # its uid reads the file (pytest makes the folder 0700)
    (tmp_path / "agent.py").write_text(
        "import os\n"
        "async def run(task, llm):\n"
        "    print('thinking out loud')\n"  # to stderr, not taken for the result
        "    assert llm.api_key == os.environ['OPENAI_API_KEY'] and llm.base_url == os.environ['OPENAI_BASE_URL']\n"
        "    return {'answer': task['messages'][0]['content'], 'metrics': {'key_len': len(llm.api_key)}}\n")
    config = load_config(None, ["agent.runner=subprocess", f"agent.entrypoint={tmp_path}/agent.py:run",
                                f"agent.subprocess.preload={preload}"])
    task = {"messages": [{"role": "user", "content": "hi"}]}
    outcome = asyncio.run(one_episode(runner_of(config.agent), task))
    assert outcome == AgentOutcome(answer="hi", metrics={"key_len": float(len(LLM_HERE.api_key))})


def test_a_command_agent_in_any_language_answers_on_its_last_line(tmp_path):
    script = ("import json, os, sys\n"
              "task = json.load(sys.stdin)\n"
              "print('log line')\n"
              "print(json.dumps({'reward': 0.25 if os.environ['OPENAI_MODEL'] == 'policy' else 0}))\n")
    settings = AgentConfig(runner="command", command=[sys.executable, "-c", script])
    assert asyncio.run(runner_of(settings).run({}, LLM_HERE)) == AgentOutcome(reward=0.25)


@pytest.mark.parametrize("script, reason, says", [
    ("print('no json here')", "garbage", "not JSON: 'no json here'"),
    ("pass", "garbage", "printed nothing"),
    ("import sys; print('boom', file=sys.stderr); sys.exit(4)", "exited", "status 4: boom"),
    ("print('[1, 2]')", "garbage", "returned \\[1, 2\\]"),
])
def test_a_process_that_fails_or_prints_garbage_fails_its_episode(script, reason, says):
    with pytest.raises(AgentFailed, match=says) as failure:
        asyncio.run(ProcessRunner([sys.executable, "-c", script]).run({}, LLM_HERE))
    assert failure.value.reason == reason


def test_a_process_past_its_time_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"

    async def scenario():
        runner = ProcessRunner([sys.executable, "-c", script])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.run({}, LLM_HERE), 3.0)

    asyncio.run(scenario())
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)


def test_an_agent_run_needs_an_outcome_estimator_and_no_environment_loop():
    agent = "agent.entrypoint=agent.py:run"
    for overrides, says in [([agent, "algorithm.adv_estimator=gae"], "outcome estimator"),
                            ([agent, "algorithm.use_kl_in_reward=true"], "use_kl_in_reward"),
                            ([agent, "rollout.multi_turn.enable=true"], "multi_turn"),
                            (["agent.runner=command", agent], "set agent.command")]:
        with pytest.raises(ConfigError, match=says):
            load_config(None, overrides)


@pytest.mark.parametrize("preload", [True, False], ids=["warm", "cold"])
def test_a_subprocess_agent_has_a_tmp_and_dev_shm_of_its_own(tmp_path, preload):
    tmp_path.chmod(0o755)
    marker = f"rlfabric-agent-{os.getpid()}-{tmp_path.name}"
    (tmp_path / "agent.py").write_text(
        "import os\n"
        "async def run(task, llm):\n"
        f"    for folder in ('/tmp', '/dev/shm'):\n"
        f"        open(os.path.join(folder, {marker!r}), 'w').write('x')\n"
        "    own = __file__.split('/')[2]\n"  # the folder its own file is bound back in (under /tmp here)
        "    return {'reward': float(len(set(os.listdir('/tmp')) - {own}) + len(os.listdir('/dev/shm')))}\n")
    config = load_config(None, ["agent.runner=subprocess", f"agent.entrypoint={tmp_path}/agent.py:run",
                                f"agent.subprocess.preload={preload}"])
    outcome = asyncio.run(one_episode(runner_of(config.agent), {}))
    assert outcome.reward == 2.0  # its own two files, nothing of this host's
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(f"/dev/shm/{marker}")


def test_the_agents_uid_range_is_apart_from_the_sandboxes_and_holds_the_concurrent_episodes():
    for overrides, says in [(["agent.uid=64300"], "overlaps env.python.sandbox's"),
                            (["agent.uid=64000"], "overlaps reward.custom_sandbox's"),
                            (["agent.runner=command", "agent.command=[sh]", "agent.uid_count=8"],
                             "agent.uid_count 8 < agent.max_concurrent_episodes 256")]:
        with pytest.raises(ConfigError, match=says):
            load_config(None, overrides)


def test_not_root_an_agent_keeps_the_services_uid_with_a_warning_or_refuses(monkeypatch, caplog):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(runners, "_warned", set())  # logged once per process
    settings = AgentConfig(runner="command", command=["sh"])
    runner = runner_of(settings)
    assert runner.uid_range is None and "agent.require_sandbox_uid makes this an error" in caplog.text
    with pytest.raises(ConfigError, match="agent.require_sandbox_uid is set, but the service runs as uid"):
        runner_of(settings.model_copy(update={"require_sandbox_uid": True}))
