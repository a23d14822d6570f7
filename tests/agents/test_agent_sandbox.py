"""Subprocess and command agents run as the reward sandbox's code does (rlfabric.agents.confinement): a uid of the
episode's own, the agent.* limits, private temp dirs; its processes killed and its uid freed after. Real
processes, as root; the run is on the in-process mesh with the tiny model."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import textwrap

import psutil
import pytest

from rlfabric.agents.llm import LLM
from rlfabric.agents.runners import runner_of
from rlfabric.core.config import AgentConfig, load_config
from rlfabric.sandbox.confine import claim_uid
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process, run_to_end

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a uid of the agent's own needs root")

LLM_HERE = LLM("http://127.0.0.1:9/v1", "rlf-ep-test", "policy")
LIMITS = [
    "agent.memory_limit_mb=1024",
    "agent.max_processes=48",
    "agent.cpu_limit_s=30",
    "agent.max_open_files=64",
]

SNOOP = textwrap.dedent(
    """
    import os, resource, subprocess, sys

    async def run(task, llm):
        try:
            open(task["extra_info"]["secret"]).read()
            secret = 1.0
        except PermissionError:
            secret = 0.0
        # A leftover that leaves the tree: a new session, reparented away from the agent's launcher.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        limits = {name: float(resource.getrlimit(getattr(resource, "RLIMIT_" + name))[0])
                  for name in ("DATA", "NPROC", "CPU", "NOFILE")}
        return {"reward": float(os.getuid()), "metrics": {"secret_read": secret, "gid": float(os.getgid()),
                                                           "groups": float(len(os.getgroups())), **limits}}
    """
)


def readable_folder(tmp_path):
    folder = tmp_path / "agent"
    folder.mkdir()
    folder.chmod(0o755)  # pytest makes tmp_path 0700: the agent's uid must read its own file
    return folder


@pytest.mark.parametrize("preload", [True, False], ids=["warm", "cold"])
def test_an_agent_runs_as_a_claimed_uid_under_the_limits_and_nothing_of_it_outlives_the_episode(
    tmp_path, preload
):
    folder = readable_folder(tmp_path)
    (folder / "agent.py").write_text(SNOOP)
    secret = folder / "token"
    secret.write_text("root's")
    secret.chmod(0o600)
    config = load_config(
        None,
        [
            "agent.runner=subprocess",
            f"agent.entrypoint={folder}/agent.py:run",
            *LIMITS,
            f"agent.subprocess.preload={preload}",
        ],
    )
    settings = config.agent

    async def episode():
        runner = runner_of(settings)
        try:
            return await runner.run({"extra_info": {"secret": str(secret)}}, LLM_HERE)
        finally:
            await runner.close()

    outcome = asyncio.run(episode())

    uid = int(outcome.reward)
    assert (
        settings.uid <= uid < settings.uid + settings.uid_count
    )  # the agents' range, apart from the sandboxes'
    assert not config.reward.custom_sandbox.uid <= uid < config.reward.custom_sandbox.uid + 64
    assert outcome.metrics["secret_read"] == 0.0  # root's 0600 file
    assert outcome.metrics["gid"] == settings.gid and outcome.metrics["groups"] == 0
    assert outcome.metrics["DATA"] == settings.memory_limit_mb * 1024 * 1024
    assert (outcome.metrics["NPROC"], outcome.metrics["CPU"], outcome.metrics["NOFILE"]) == (48, 30, 64)
    assert not [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]
    claim = claim_uid(uid, 1)  # freed: its lock released (claim_uid raises when the uid is held)
    claim.release()


def test_a_command_agents_tmp_is_its_own_and_gone_after_the_episode(tmp_path):
    marker = f"rlfabric-agent-{os.getpid()}-{tmp_path.name}"
    script = (
        f"seen=0; [ -e /tmp/{marker} ] && seen=1; [ -e /dev/shm/{marker} ] && seen=1\n"
        f"echo x > /tmp/{marker} && echo x > /dev/shm/{marker} || exit 3\n"
        'echo "{\\"reward\\": $seen}"\n'
    )
    runner = runner_of(AgentConfig(runner="command", command=["sh", "-c", script]))
    first, second = (asyncio.run(runner.run({}, LLM_HERE)) for _ in range(2))
    assert first.reward == 0.0 and second.reward == 0.0  # it wrote them both times; the second saw none
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(
        f"/dev/shm/{marker}"
    )  # nor does the host


HOG = textwrap.dedent(
    """
    import hashlib, os
    from openai import AsyncOpenAI

    async def run(task, llm):
        async with AsyncOpenAI(max_retries=0) as client:  # OPENAI_BASE_URL, OPENAI_API_KEY: the episode's
            await client.chat.completions.create(model=llm.model, messages=task["messages"], max_tokens=2)
        if int(hashlib.sha1(task["uid"].encode()).hexdigest(), 16) % 2:
            hog = [bytearray(64 * 1024 * 1024) for _ in range(64)]  # 4 GiB, past agent.memory_limit_mb
            return float(len(hog))
        return {"reward": 1.0, "metrics": {"uid": float(os.getuid())}}
    """
)


def is_hog(uid: str) -> bool:
    return bool(int(hashlib.sha1(uid.encode()).hexdigest(), 16) % 2)


@pytest.mark.slow  # a training run of 8 subprocess episodes: 65 s here (115 s while the 2 cores were loaded)
def test_a_memory_hog_fails_its_episode_and_the_run_goes_on(tiny_model, tmp_path):
    folder = readable_folder(tmp_path)
    (folder / "agent.py").write_text(HOG)
    config = fast_config(
        tiny_model,
        "agent.runner=subprocess",
        f"agent.entrypoint={folder}/agent.py:run",
        "agent.memory_limit_mb=1024",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
        "trainer.total_steps=1",
        "trainer.export_final=false",
        "trainer.dump_rollouts=true",
        "algorithm.max_failed_fraction=0.9",
    )
    metrics, status = run_to_end(in_process, config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    ]
    hogs = {row["uid"] for row in rows if is_hog(row["uid"])}
    step = metrics[1]
    assert step["agent/episodes"] == 8
    assert step["agent/failed/exited"] == 2 * len(hogs)  # each hog's episodes, MemoryError under RLIMIT_DATA
    assert 0 < len(hogs) < 4, "the seeded prompts give hogs and others both"
    assert len(rows) == 8 and all(
        row["score_failed"] == is_hog(row["uid"]) for row in rows
    )  # each made a call


def test_another_venvs_interpreter_keeps_its_venv_and_base_installation_reachable(tmp_path):
    """A command agent run by another venv's python (verifiers' side venv): the link, the venv's packages and the
    base installation it links into are bound back, not only the link's target folder."""
    import sys

    from rlfabric.agents.confinement import reachable_paths

    venv = tmp_path / "side-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {os.path.dirname(sys.executable)}\n")
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    kept = reachable_paths([str(venv / "bin" / "python"), "-c", "pass"])
    covered = lambda path: any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept)  # noqa: E731
    assert covered(str(venv.resolve()))
    assert covered(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
