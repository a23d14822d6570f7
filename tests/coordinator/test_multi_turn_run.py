"""Multi-turn runs on the lookup task: the coordinator asks the rollout for agent loops against the
environment service, trains on the model's tokens only, scores from the environment (or the reward
service, or both), and reports agent/* metrics; on the in-process mesh and over gRPC."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfabric.coordinator.peers import Peers
from rlfabric.core.config import load_config
from rlfabric.core.errors import Unavailable
from rlfabric.data.prep import write_lookup
from rlfabric.v1 import coordinator_pb2
from tests.conftest import closed_port
from tests.coordinator.meshes import FAST, MESHES, fast_config, in_process, run_to_the_end

pytestmark = pytest.mark.slow

MULTI_TURN = ["data.builtin_task=lookup", "env.enable=true", "rollout.multi_turn.enable=true",
              "rollout.multi_turn.max_turns=2", "data.max_prompt_length=96", "data.max_response_length=24",
              "trainer.dump_rollouts=true"]


def run(mesh_kind, config, run_dir):
    async def scenario():
        async with MESHES[mesh_kind](config, run_dir) as coordinator:
            await coordinator.start_run()
            metrics = {update.step: dict(update.metrics) async for update in coordinator.stream_metrics(from_step=1)}
            return metrics, await coordinator.run_status()

    return asyncio.run(scenario())


@pytest.mark.parametrize("mesh_kind", ["in-process", "grpc"])
def test_a_multi_turn_run_trains_and_reports_agent_metrics(tiny_model, tmp_path, mesh_kind):
    config = fast_config(tiny_model, *MULTI_TURN)
    metrics, status = run(mesh_kind, config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    for step in (1, 2):
        step_metrics = metrics[step]
        assert 1 <= step_metrics["agent/turns/mean"] <= 2
        assert step_metrics["agent/env_failed/count"] == 0
        assert step_metrics["critic/score/mean"] == pytest.approx(step_metrics["agent/env_reward/mean"])
        assert 0 < step_metrics["agent/model_token_fraction"] <= 1
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"agent/tool_calls/mean"' in lines and '"agent/env_seconds/mean"' in lines


def test_a_run_whose_environment_nobody_listens_at_fails_before_its_first_step(tiny_model, tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    config = fast_config(tiny_model, *MULTI_TURN, "env.enable=false", f"rollout.multi_turn.env_address={address}",
                         "client.connect_timeout_s=2")

    async def scenario():
        async with in_process(config, tmp_path / "run") as coordinator:
            started = time.monotonic()
            with pytest.raises(Unavailable) as refused:
                await coordinator.start_run()
            return refused.value, time.monotonic() - started, await coordinator.run_status()

    error, seconds, status = asyncio.run(scenario())
    assert f"env at {address} (rollout.multi_turn.env_address) is not ready" in str(error)
    assert "Connection refused" in str(error) and seconds < 2 + 10  # the readiness wait: client.connect_timeout_s
    assert status.state == coordinator_pb2.RUN_STATE_UNSPECIFIED and status.step == 0  # no run started
    assert not (tmp_path / "run" / "final_model").exists()


def test_a_multi_turn_runs_readiness_wait_over_grpc_includes_its_environment():
    async def waited_for(*overrides: str) -> tuple[list[tuple[str, str]], str]:
        config = load_config(None, ["rollout.multi_turn.enable=true", *overrides])
        for role, port in (("actor", 1), ("rollout", 2), ("reward", 3), ("env", 4)):
            setattr(config.cluster, role, [f"127.0.0.1:{port}"])
        peers = Peers.connect(config)
        try:
            return [(c.role, c.address) for c in peers.grpc_clients()], peers.env_key
        finally:
            await peers.close()

    clients, key = asyncio.run(waited_for())
    assert ("env", "127.0.0.1:4") in clients and key == "cluster.env"
    clients, key = asyncio.run(waited_for("rollout.multi_turn.env_address=env.example:7"))
    assert ("env", "env.example:7") in clients and key == "rollout.multi_turn.env_address"
    clients, _ = asyncio.run(waited_for("rollout.multi_turn.enable=false"))
    assert "env" not in {role for role, _ in clients}  # a single-turn run does not need it


@pytest.mark.slow
def test_train_exits_non_zero_when_the_environment_is_unreachable(tiny_model, tmp_path):
    """The command of the report: every sample failed every step, and it exited 0 with a final model."""
    run_dir, address = tmp_path / "run", f"127.0.0.1:{closed_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "rlfabric", "train", "--in-process", "--run-dir", str(run_dir),
         f"model.path={tiny_model}", *FAST, *MULTI_TURN, "env.enable=false",
         f"rollout.multi_turn.env_address={address}", "client.connect_timeout_s=2"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"UNAVAILABLE: env at {address} (rollout.multi_turn.env_address) is not ready" in done.stderr
    assert not (run_dir / "final_model").exists()


@pytest.mark.slow
def test_the_process_launcher_gives_its_rollout_replicas_the_env_it_starts(tiny_model, tmp_path):
    """A rollout replica calls only an environment its own config names: `rlfabric up` starts the env
    service first and the replicas once its address is their config's cluster.env (RUN_DIR/config.yaml),
    so a multi-turn run on the process mesh reaches it with every sample."""
    from rlfabric.launch.local import LocalMesh

    config = fast_config(tiny_model, *MULTI_TURN, "trainer.total_steps=1")
    with LocalMesh(config, tmp_path / "run") as mesh:
        assert load_config(mesh.run_dir / "config.yaml").cluster.env == [mesh.endpoints["env"][0]["grpc"]]
        metrics, status = run_to_the_end(mesh)
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert metrics[-1]["agent/env_failed/count"] == 0 and metrics[-1]["agent/turns/mean"] >= 1, metrics[-1]


def lookup_data_for(tmp_path: Path, environment: str) -> Path:
    """The lookup task's training rows with extra_info.environment set to `environment`."""
    rows = pq.read_table(write_lookup(tmp_path / "data", train_size=16, val_size=1)["train"]).to_pylist()
    for row in rows:
        row["extra_info"]["environment"] = environment
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "train.parquet")
    return tmp_path / "data" / "train.parquet"


def test_a_step_whose_environment_failed_most_samples_fails_the_run_with_the_reasons(tiny_model, tmp_path):
    # The environment is up, but serves no environment the rows name: every Reset is INVALID_ARGUMENT.
    data = lookup_data_for(tmp_path, "no-such-environment")
    config = fast_config(tiny_model, *MULTI_TURN, f"data.train_files=[{data}]", "data.val_files=[]")
    metrics, status = run("in-process", config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and metrics == {} and status.step == 0
    assert "step 1: 32 of 32 samples failed (env INVALID_ARGUMENT: 32)" in status.error
    assert "algorithm.max_failed_fraction=0.5" in status.error
    assert not (tmp_path / "run" / "final_model").exists()
    dumped = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(dumped) == 32 and all(row["score_failed"] for row in dumped)
    for row in dumped:
        failure = row["failure"]
        assert (failure["source"], failure["status"]) == ("env", "INVALID_ARGUMENT")
        assert failure["message"].startswith("Reset: INVALID_ARGUMENT: unknown environment 'no-such-environment'")


def test_failed_samples_are_left_out_and_the_run_goes_on_up_to_the_failed_fraction(tiny_model, tmp_path):
    data = lookup_data_for(tmp_path, "no-such-environment")
    config = fast_config(tiny_model, *MULTI_TURN, f"data.train_files=[{data}]", "data.val_files=[]",
                         "algorithm.max_failed_fraction=1", "trainer.total_steps=1")
    metrics, status = run("in-process", config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert metrics[1]["agent/env_failed/count"] == 32  # left out of training, the run goes on
    assert metrics[1]["reward/score_failed/count"] == 32
