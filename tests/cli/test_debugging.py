"""The two ways to debug (README, Debugging): `rlfabric train --in-process`, every role in one process,
and a live mesh with one role left out of `rlfabric up` (--external) for you to serve yourself."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest

from rlfabric.cli.up import _external_roles
from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import ConfigError
from rlfabric.core.server import ServerOptions
from rlfabric.launch.local import LocalMesh, write_mesh_token
from rlfabric.serve import build_service
from rlfabric.v1 import coordinator_pb2
from tests.conftest import ServerThread
from tests.coordinator.meshes import FAST, fast_config

pytestmark = pytest.mark.slow


def test_train_in_process_runs_every_role_in_one_process(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlfabric", "train", "--in-process", "--run-dir", str(run_dir),
         f"model.path={tiny_model}", *FAST],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RUN_STATE_COMPLETED at step 2" in done.stdout
    assert (run_dir / "final_model" / "config.json").exists()
    assert not (run_dir / "ports").exists()  # no service was launched: no process reported a port


def test_train_in_process_refuses_options_of_other_launchers(tiny_model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "rlfabric", "train", "--in-process", "--coordinator", "h:1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--in-process runs every role in this process" in done.stderr


def test_external_roles_are_checked():
    assert _external_roles(["actor=127.0.0.1:1", "rollout=h:2", "rollout=h:3"]) == {
        "actor": ["127.0.0.1:1"], "rollout": ["h:2", "h:3"]}
    with pytest.raises(ConfigError, match="give ROLE=HOST:PORT"):
        _external_roles(["actor"])
    config = fast_config("unused")
    for role in ("coordinator", "critic", "nonsense"):  # the launcher's own, one GRPO does not run, no role
        with pytest.raises(ConfigError, match=f"--external {role}: not a role"):
            LocalMesh(config, external={role: ["127.0.0.1:1"]})


@pytest.mark.slow
def test_up_leaves_an_external_role_to_whoever_serves_it(tiny_model, tmp_path):
    """The reward is served here (as `rlfabric serve reward` under a debugger would); the mesh's runs score there."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = fast_config(tiny_model, "trainer.total_steps=1")
    config.server.auth_token_file = str(write_mesh_token(run_dir))  # the mesh's token, for both sides
    reward = build_service("reward", config)
    server = ServerThread(reward, ServerOptions.from_config(config.server, port=0, metrics_port=0))
    try:
        with LocalMesh(config, run_dir, external={"reward": [server.address]}) as mesh:
            assert "reward" not in {p.role for p in mesh.processes}
            options = dataclasses.replace(ChannelOptions.from_config(config), timeout_s=300)

            async def one_run():
                async with CoordinatorClient(mesh.endpoints["coordinator"][0]["grpc"], options) as client:
                    await client.start_run()
                    [_ async for _ in client.stream_metrics()]
                    return await client.run_status()

            status = asyncio.run(one_run())
    finally:
        server.stop()
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert reward.engine.status().items_scored == 8 * 4  # one step: 8 prompts x 4 samples, scored here
