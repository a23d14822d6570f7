"""Smoke test of the real entry point: `python -m rlfabric serve env` imports the configured
environment modules, serves sessions, exports its metrics, never loads torch, and exits 0 on SIGTERM;
an env.name nothing registered stops it at start with a message naming the key."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlfabric.core.client import wait_until_serving
from rlfabric.core.errors import ResourceExhausted
from rlfabric.env.client import EnvClient
from rlfabric.env.items import Action, Task

CONFIG = """\
env:
  name: echo
  environment_modules: [echo_environment]
  max_action_bytes: 64
"""
ECHO_MODULE = '''
from rlfabric.env import Environment, register_environment
from rlfabric.env.items import Message, StepResult

class Echo(Environment):
    def __init__(self, task, config):
        self.task = task

    def reset(self):
        return [Message("user", self.task.prompt)]

    def step(self, action):
        return StepResult([Message("user", action.text.upper())], reward=0.5, done=True)

register_environment("echo", lambda task, config: Echo(task, config))
'''


def serve_env(tmp_path: Path, config_text: str) -> subprocess.Popen:
    (tmp_path / "run.yaml").write_text(config_text)
    (tmp_path / "echo_environment.py").write_text(ECHO_MODULE)
    command = [sys.executable, "-m", "rlfabric", "serve", "env", "--config", str(tmp_path / "run.yaml"),
               "--port", "0", "--metrics-port", "0", "--port-file", str(tmp_path / "ports.json")]
    # (no LD_PRELOAD an in-process vLLM engine of an earlier test may have left: see test_reward_serve)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture
def served(tmp_path):
    process = serve_env(tmp_path, CONFIG)
    port_file = tmp_path / "ports.json"
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert process.poll() is None, f"serve exited {process.returncode}: {process.stdout.read()}"
        assert time.monotonic() < deadline, "no port file within 60 s"
        time.sleep(0.05)
    yield process, json.loads(port_file.read_text())
    if process.poll() is None:
        process.kill()
        process.wait()


def test_serve_env_entry_point(served):
    process, ports = served
    address = f"127.0.0.1:{ports['grpc']}"

    async def talk():
        await wait_until_serving(address, timeout_s=60)
        async with EnvClient(address) as client:
            session = await client.reset(Task(prompt="hello"))
            with pytest.raises(ResourceExhausted, match="env.max_action_bytes=64"):
                await client.step(session.session_id, Action("x" * 65))
            result = await client.step(session.session_id, Action("shout"))
            return session, result, await client.status()

    session, result, status = asyncio.run(talk())
    # The config reached the engine: the module's environment is the default one.
    assert [m.content for m in session.observation] == ["hello"]
    assert ([m.content for m in result.observation], result.reward, result.done) == (["SHOUT"], 0.5, True)
    assert {"echo", "calculator", "python", "lookup"} <= set(status.environments)

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).read().decode()
    assert 'rlfabric_env_steps_total{status="ok"} 1.0' in metrics
    assert "rlfabric_env_sessions_open 1.0" in metrics

    maps = Path(f"/proc/{ports['pid']}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_serve_env_refuses_an_unregistered_default(tmp_path):
    process = serve_env(tmp_path, "env:\n  name: chess\n")
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "env.name: no environment 'chess'; registered: calculator, lookup, python" in output
