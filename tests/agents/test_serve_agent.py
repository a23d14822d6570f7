"""`rlfabric serve agent` (rlfabric.agents.servicer): a real AgentService host process on loopback, serving an
unchanged openai-SDK agent with the subprocess runner (its warm host), asked by the mesh's runner service
(agent.runner service, ServiceRunner) for an episode that calls a real gateway, which records it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rlfabric.agents.llm import LLM
from rlfabric.agents.outcome import AgentFailed
from rlfabric.agents.runners import runner_of
from rlfabric.agents.service import read_agent_token
from rlfabric.core.config import AgentConfig, ConfigError, load_config
from tests.gateway.helpers import GatewayMesh
from tests.waiting import wait_until

AGENT = textwrap.dedent(
    """
    import os
    from openai import AsyncOpenAI


    async def run(task, llm):
        async with AsyncOpenAI(max_retries=0) as client:  # OPENAI_BASE_URL, OPENAI_API_KEY: the episode's
            reply = await client.chat.completions.create(model=llm.model, messages=task["messages"], max_tokens=4)
        return {"reward": 1.0, "answer": reply.choices[0].message.content or "", "metrics": {"uid": float(os.getuid())}}
    """
)


@pytest.fixture(scope="module")
def mesh(tiny_model):
    mesh = GatewayMesh(tiny_model)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """`rlfabric serve agent` on a free loopback port: (its address, its token file); stopped by SIGTERM after,
    which it must answer by draining and exiting 0."""
    folder = tmp_path_factory.mktemp("agent-host")
    folder.chmod(0o755)  # the episodes' uid reads the agent's file
    (folder / "agent.py").write_text(AGENT)
    token = folder / "token"
    token.write_text("agent-host-secret\n")
    port_file = folder / "ports.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlfabric",
            "serve",
            "agent",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--port-file",
            str(port_file),
            "agent.runner=subprocess",
            f"agent.entrypoint={folder}/agent.py:run",
            f"agent.auth_token_file={token}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: port_file.exists() or process.poll() is not None, 120, "the agent host's port file"
        )
        assert process.poll() is None, process.stderr.read()
        yield f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}", token
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def ask(address: str, *overrides: str):
    return runner_of(
        load_config(None, ["agent.runner=service", f"agent.address={address}", *overrides]).agent
    )


def episode(mesh: GatewayMesh, runner):
    """One episode through the mesh's gateway: (its outcome, the calls the gateway recorded)."""
    opened = mesh.call(mesh.gateway.episodes.open)
    task = {"messages": [{"role": "user", "content": "hi"}]}

    async def run_and_close():
        try:
            return await runner.run(task, LLM(mesh.gateway.base_url, opened.key, mesh.gateway.model))
        finally:
            await runner.close()

    try:
        outcome = asyncio.run(run_and_close())
    finally:
        record = mesh.call(mesh.gateway.episodes.close, opened.key)
    return outcome, record.calls


def test_the_mesh_runs_an_episode_on_the_agent_host_through_the_gateway(mesh, host):
    address, token = host
    outcomes = [episode(mesh, ask(address, f"agent.auth_token_file={token}")) for _ in range(2)]
    for outcome, calls in outcomes:
        assert outcome.reward == 1.0 and len(calls) == 1  # the agent's call reached the gateway, recorded
        assert outcome.answer == (
            calls[0].message["content"] or ""
        )  # what the agent read is what was recorded
        assert calls[0].token_ids
        if os.geteuid() == 0:
            assert (
                outcome.metrics["uid"] >= AgentConfig().uid
            )  # the host's runner confines it to a uid of its own


def test_a_request_without_the_hosts_token_fails_the_episode(mesh, host, tmp_path):
    address, _ = host
    with pytest.raises(AgentFailed, match="UNAUTHENTICATED") as failure:
        episode(mesh, ask(address))
    assert failure.value.reason == "host_error"
    mesh_token = tmp_path / "mesh-token"
    mesh_token.write_text("the-mesh")
    with pytest.raises(ConfigError, match="holds the mesh's token"):
        read_agent_token(AgentConfig(auth_token_file=str(mesh_token)), "the-mesh")
    with pytest.raises(ConfigError, match="agent.runner is service, but rlfabric serve agent runs"):
        from rlfabric.agents.servicer import build_service

        build_service(load_config(None, ["agent.runner=service", "agent.address=127.0.0.1:1"]))
