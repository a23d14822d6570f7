"""The warm agent host (agent.subprocess.preload, rlfabric.agents.forkserver): it imports the agent's installed
dependencies once and never its file; each episode is a confined child, killed at its timeout; a host that dies
fails its episodes and is replaced; an episode costs a fork, not an interpreter. Real processes, no model (the
sandbox's and the network's tests run the warm path too: test_agent_sandbox.py, test_agent_network.py,
test_runners.py)."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import textwrap

import psutil
import pytest

from rlfabric.agents.forkserver import preloadable
from rlfabric.agents.llm import LLM
from rlfabric.agents.outcome import AgentFailed
from rlfabric.agents.runners import WarmProcessRunner, runner_of
from rlfabric.core.config import load_config
from tests.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the episode's uid and namespaces need root")

LLM_HERE = LLM("http://127.0.0.1:9/v1", "rlf-ep-test", "policy")
AGENT = textwrap.dedent(
    """
    import asyncio, os, time
    import numpy
    from openai import AsyncOpenAI

    import helper  # this folder's (the working directory's): agent code, never the host's

    IMPORTED_BY = (os.getpid(), os.getuid())
    try:  # only root could: the agent's uid finds its folder bound read-only
        with open(os.path.join(os.path.dirname(__file__), "imported_as_root"), "a") as log:
            log.write(str(os.getpid()))
    except OSError:
        pass


    async def run(task, llm):
        kind = task["kind"]
        if kind == "raise":
            raise KeyError("no such tool")
        if kind == "sleep":
            await asyncio.sleep(3600)
        AsyncOpenAI()  # the SDK's client, from OPENAI_BASE_URL and OPENAI_API_KEY
        return {"reward": float(os.getuid()), "metrics": {
            "pid": float(os.getpid()), "draw": float(numpy.random.rand()), "helper": float(helper.VALUE),
            "imported_pid": float(IMPORTED_BY[0]), "imported_uid": float(IMPORTED_BY[1])}}
    """
)


@pytest.fixture(scope="module")
def agent_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    folder.chmod(0o755)  # the episode's uid reads its files
    (folder / "agent.py").write_text(AGENT)
    (folder / "helper.py").write_text("VALUE = 7\n")
    return folder


def warm_runner(folder, *overrides: str) -> WarmProcessRunner:
    config = load_config(
        None,
        [
            "agent.runner=subprocess",
            f"agent.entrypoint={folder}/agent.py:run",
            f"agent.working_dir={folder}",
            "agent.subprocess.preload=true",
            *overrides,
        ],
    )
    runner = runner_of(config.agent)
    assert isinstance(runner, WarmProcessRunner)
    return runner


def test_the_host_imports_only_installed_packages_and_the_agents_file_runs_only_confined(agent_folder):
    """And an agent that raises exits with its traceback, as an interpreter would."""
    assert preloadable(f"{agent_folder}/agent.py:run") == ["asyncio", "os", "time", "numpy", "openai"]

    async def scenario():
        runner = warm_runner(agent_folder)
        try:
            outcomes = [await runner.run({"kind": "report"}, LLM_HERE) for _ in range(2)]
            with pytest.raises(AgentFailed, match="(?s)exited with status 1: .*KeyError: 'no such tool'"):
                await runner.run({"kind": "raise"}, LLM_HERE)
            return outcomes, runner.host.process.pid, runner.host.ready.result()
        finally:
            await runner.close()

    outcomes, host_pid, ready = asyncio.run(scenario())
    assert ready["preloaded"][-2:] == ["numpy", "openai"] and ready["threads"] == 1
    assert not (agent_folder / "imported_as_root").exists()  # the host (root) never ran the file
    for outcome in outcomes:  # each episode's process imported it, as the episode's uid
        assert outcome.metrics["imported_pid"] == outcome.metrics["pid"] != host_pid
        assert outcome.metrics["imported_uid"] == outcome.reward != 0
    assert outcomes[0].metrics["pid"] != outcomes[1].metrics["pid"]
    assert outcomes[0].metrics["draw"] != outcomes[1].metrics["draw"]  # numpy reseeded per fork
    assert outcomes[0].metrics["helper"] == 7.0


def agent_pids(settings_uid: int = 64320, count: int = 256) -> list[int]:
    """The processes running as a uid of the agents' range (agent.uid, agent.uid_count defaults)."""
    return [
        process.pid
        for process in psutil.process_iter(["uids"])
        if process.info["uids"] and settings_uid <= process.info["uids"].real < settings_uid + count
    ]


def test_an_episode_past_its_time_is_killed_and_a_host_that_dies_is_replaced(agent_folder):
    """A cancelled episode (agent.timeout_s) is killed and the host serves the next; a host killed mid-episode
    fails that episode, and the next starts a new host."""

    async def sleeping_episode(runner):
        episode = asyncio.ensure_future(runner.run({"kind": "sleep"}, LLM_HERE))
        (pid,) = await wait_until_async(agent_pids, 60, "the agent running as its uid")
        return episode, pid

    async def scenario():
        runner = warm_runner(agent_folder)
        try:
            episode, pid = await sleeping_episode(runner)
            episode.cancel()  # what agent.timeout_s does
            with pytest.raises(asyncio.CancelledError):
                await episode
            await wait_until_async(lambda: not psutil.pid_exists(pid), 10, "the agent killed and reaped")
            first = runner.host.process.pid
            served = await runner.run({"kind": "report"}, LLM_HERE)
            assert runner.host.process.pid == first and served.reward >= 1  # the same host served the next

            episode, _ = await sleeping_episode(runner)
            os.kill(first, signal.SIGKILL)
            with pytest.raises(AgentFailed, match="the warm agent host exited"):
                await episode
            outcome = await runner.run({"kind": "report"}, LLM_HERE)
            return first, runner.host.process.pid, outcome
        finally:
            await runner.close()

    first, second, outcome = asyncio.run(scenario())
    assert first != second and outcome.reward >= 1
    wait_until(lambda: not psutil.pid_exists(first), 10, "the first host reaped")


def test_a_warm_episode_costs_a_fork_not_an_interpreter(agent_folder):
    """CPU seconds per episode: cold (a new interpreter that imports openai and numpy) against warm (a fork of
    the host that imported them)."""

    async def episodes(preload: bool, count: int):
        runner = runner_of(
            load_config(
                None,
                [
                    "agent.runner=subprocess",
                    f"agent.entrypoint={agent_folder}/agent.py:run",
                    f"agent.working_dir={agent_folder}",
                    f"agent.subprocess.preload={preload}",
                ],
            ).agent
        )
        try:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            for _ in range(count):
                await runner.run({"kind": "report"}, LLM_HERE)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if preload:
                return runner.host.cpu_s / runner.host.episodes, runner.host.ready.result()["import_s"]
            return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / count, 0.0
        finally:
            await runner.close()

    cold, _ = asyncio.run(episodes(False, 2))
    warm, import_s = asyncio.run(episodes(True, 4))
    print(
        f"CPU per episode: cold {cold:.3f} s, warm {warm:.3f} s (the host's imports: {import_s:.2f} s once)"
    )
    # Both episodes do the same work (a client made, no call); the cold one also starts Python and imports the
    # agent's packages, which is most of its cost: a warm one costs less than half.
    assert warm < cold / 2
