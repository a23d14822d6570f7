"""The Node.js client (examples/clients/node/run.js, @grpc/grpc-js with the protos loaded at run time)
against a live local mesh: status, a whole short run, and clear failures."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.tracking import read_metrics
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.launch.local import LocalMesh
from rlfabric.v1 import coordinator_pb2

CLIENT_DIR = Path(__file__).parents[2] / "examples" / "clients" / "node"
NODE = shutil.which("node")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NODE is None, reason="node is not installed (`make system-deps` installs it)")]
@pytest.fixture(scope="module")
def run_js() -> list[str]:
    """`node run.js`, with the pinned dependencies from package-lock.json installed (npm ci) if missing."""
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm, "node is installed but npm is not"
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT_DIR, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    return [NODE, str(CLIENT_DIR / "run.js")]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A live local mesh for a very short run."""
    config = load_config(None, ["trainer.total_steps=2", "data.train_batch_size=4", "rollout.n=2",
                                "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4"])
    with LocalMesh(config, tmp_path_factory.mktemp("node-client") / "run") as mesh:
        yield mesh


@pytest.fixture(scope="module")
def coordinator_address(mesh):
    return mesh.endpoints["coordinator"][0]["grpc"]


@pytest.fixture(scope="module")
def node(run_js, mesh):
    """Runs run.js with the mesh's token in RLFABRIC_TOKEN, as its README says."""
    env = {**os.environ, "RLFABRIC_TOKEN": (mesh.run_dir / "auth_token").read_text().strip()}

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*run_js, *args], capture_output=True, text=True, timeout=timeout, cwd=CLIENT_DIR,
                              env=env)

    return run


@pytest.fixture(scope="module")
def python_status(mesh, coordinator_address):
    def status() -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        async def query():
            async with CoordinatorClient(coordinator_address, ChannelOptions.from_config(mesh.config)) as client:
                return await client.run_status(timeout_s=10)

        return asyncio.run(query())

    return status


def test_status_only_reads_the_live_coordinator(node, python_status, coordinator_address):
    done = node(coordinator_address, "--status-only")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    expected = python_status()
    # enums arrive as names, int64 as strings (proto-loader's enums: String, longs: String).
    assert status["state"] == coordinator_pb2.RunState.Name(expected.state)
    assert status["run_id"] == expected.run_id
    assert status["total_steps"] == str(expected.total_steps)
    assert set(status) == {f.name for f in coordinator_pb2.CoordinatorServiceGetRunStatusResponse.DESCRIPTOR.fields}


def test_bad_override_is_refused_with_the_status_name(node, coordinator_address):
    done = node(coordinator_address, "trainer.no_such_key=1")
    assert done.returncode == 1
    assert done.stderr.startswith("error: StartRun: INVALID_ARGUMENT: "), done.stderr
    assert "trainer.no_such_key" in done.stderr


def test_node_client_runs_training_to_completion(node, python_status, coordinator_address, experiment_dir):
    done = node(coordinator_address, "trainer.total_steps=2", f"trainer.experiment_name={experiment_dir.name}", timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"run \S+ started at step 0", lines[0]), lines
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/2", "2/2"], lines
    for line in step_lines:
        assert re.search(r" critic/score/mean=-?[0-9.e+-]+( |$)", line), line
    assert re.fullmatch(r"run \S+ completed: step 2/2", lines[-1]), lines
    assert python_status().state == coordinator_pb2.RUN_STATE_COMPLETED
    # The coordinator's sinks wrote the run: what the client printed is what metrics.jsonl holds.
    records = read_metrics(experiment_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for line, record in zip(step_lines, records, strict=True):
        shown = float(re.search(r"critic/score/mean=(\S+)", line).group(1))
        assert shown == pytest.approx(record["critic/score/mean"], rel=1e-3, abs=1e-6)
    assert (experiment_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((experiment_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_without_the_mesh_token_the_call_is_unauthenticated(run_js, coordinator_address):
    env = {k: v for k, v in os.environ.items() if k != "RLFABRIC_TOKEN"}
    done = subprocess.run([*run_js, coordinator_address, "--status-only"], capture_output=True, text=True,
                          timeout=60, cwd=CLIENT_DIR, env=env)
    assert done.returncode == 1
    assert done.stderr.startswith("error: GetRunStatus: UNAUTHENTICATED: "), done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wrong_address_fails_fast_with_unavailable(node):
    started = time.monotonic()
    done = node(f"127.0.0.1:{free_port()}", timeout=30)
    assert time.monotonic() - started < 20
    assert done.returncode == 1
    assert done.stderr.startswith("error: StartRun: UNAVAILABLE: "), done.stderr
    assert done.stdout == ""


def test_usage_error_exits_2(node):
    done = node()
    assert done.returncode == 2 and done.stderr.startswith("usage: node run.js HOST:PORT")
