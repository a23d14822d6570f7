"""Subprocess and command agents' network (agent.network_isolation, rlfabric.agents.jail): an unchanged openai-SDK
agent completes its episode through a real gateway, while another port of this host and an outside address do
not answer it; without a namespace, a warning or (require_network_isolation) a failed episode."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import textwrap

import pytest

from rlfabric.agents.llm import LLM
from rlfabric.agents.outcome import AgentFailed
from rlfabric.agents.runners import ProcessRunner, WarmProcessRunner
from tests.gateway.helpers import GatewayMesh

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace per agent needs root")

AGENT = textwrap.dedent(
    """
    import asyncio, json, os, socket, sys
    from openai import AsyncOpenAI


    def answers(host, port):
        try:
            socket.create_connection((host, port), timeout=3).close()
            return 1.0
        except OSError:
            return 0.0


    async def main():
        task = json.load(sys.stdin)
        reply = await AsyncOpenAI().chat.completions.create(
            model=os.environ["OPENAI_MODEL"], messages=task["messages"], max_tokens=4)
        other = task["extra_info"]["other_port"]
        print(json.dumps({"reward": 1.0, "answer": reply.choices[0].message.content or "",
                          "metrics": {"host_port": answers("127.0.0.1", other), "outside": answers("1.1.1.1", 53)}}))


    asyncio.run(main())
    """
)


# The same agent as an entrypoint, for the subprocess runner's warm host (rlfabric.agents.forkserver).
ENTRYPOINT = (
    AGENT.replace("async def main():\n    task = json.load(sys.stdin)", "async def run(task, llm):")
    .replace("print(json.dumps(", "return ((")
    .replace("\n\n\nasyncio.run(main())\n", "\n")
)


@pytest.fixture(scope="module")
def mesh(tiny_model):
    mesh = GatewayMesh(tiny_model)
    yield mesh
    mesh.stop()


@pytest.fixture
def agent(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return [sys.executable, str(path)]


def episode(mesh: GatewayMesh, runner: ProcessRunner, other_port: int):
    """One episode of runner's agent through the mesh's gateway, the runner closed after: (its outcome, the calls
    the gateway recorded)."""
    opened = mesh.call(mesh.gateway.episodes.open)
    task = {"messages": [{"role": "user", "content": "hi"}], "extra_info": {"other_port": other_port}}
    llm = LLM(mesh.gateway.base_url, opened.key, mesh.gateway.model)

    async def run_and_close():
        try:
            return await runner.run(task, llm)
        finally:
            await runner.close()

    try:
        outcome = asyncio.run(run_and_close())
    finally:
        record = mesh.call(mesh.gateway.episodes.close, opened.key)
    return outcome, record.calls


@pytest.mark.parametrize("warm", [False, True], ids=["process", "warm-host"])
@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "host-network"])
def test_the_agent_reaches_the_gateway_and_nothing_else(mesh, agent, tmp_path, isolated, warm):
    if warm:
        (tmp_path / "entry.py").write_text(ENTRYPOINT)
        runner = WarmProcessRunner(f"{tmp_path}/entry.py:run", agent, network_isolation=isolated)
    else:
        runner = ProcessRunner(agent, network_isolation=isolated)
    with socket.create_server(("127.0.0.1", 0)) as other:  # a service of this host, not the gateway
        outcome, calls = episode(mesh, runner, other.getsockname()[1])
    assert outcome.reward == 1.0 and len(calls) == 1  # the call went through the gateway and was recorded
    assert outcome.metrics["host_port"] == float(
        not isolated
    )  # without the namespace the same agent gets there
    if isolated:
        assert outcome.metrics["outside"] == 0.0


SETPRIV = shutil.which("setpriv")
NO_SYS_ADMIN = [SETPRIV, "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"] if SETPRIV else []


@pytest.mark.skipif(not SETPRIV, reason="setpriv drops CAP_SYS_ADMIN, so that unshare is refused")
@pytest.mark.parametrize("require", [False, True], ids=["warning", "required"])
def test_without_a_namespace_a_warning_or_a_failed_episode(mesh, agent, require):
    runner = ProcessRunner(agent, network_isolation=True, require_network_isolation=require)
    inner = runner.command_line
    # the jail lacks CAP_SYS_ADMIN
    runner.command_line = lambda llm, uid=None: [*NO_SYS_ADMIN, *inner(llm, uid)]
    with socket.create_server(("127.0.0.1", 0)) as other:
        if require:
            with pytest.raises(AgentFailed, match="cannot isolate the agent from the network.*does not run"):
                episode(mesh, runner, other.getsockname()[1])
        else:
            outcome, calls = episode(mesh, runner, other.getsockname()[1])
            assert outcome.metrics["host_port"] == 1.0 and len(calls) == 1  # it ran, on this host's network
