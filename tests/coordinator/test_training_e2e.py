"""End to end on CPU: the coordinator's PPO/GRPO loop over a live local mesh (one mesh per module,
two rollout replicas). Each run gets its own trainer.run_dir through StartRun overrides.

Order matters: the last test kills a rollout replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from rlfabric.launch.local import LocalMesh
from rlfabric.v1 import coordinator_pb2
from tests.waiting import wait_until_async

pytestmark = pytest.mark.slow

# Short runs on the quickstart's task (services/quickstart/quickstart.yaml), except the first,
# which is the whole quickstart.
STEPS = 4


# The mesh starts as PPO (GAE) so that it runs a critic for the PPO test; the others run GRPO, the
# quickstart's estimator, through this StartRun override.
GRPO = "algorithm.adv_estimator=grpo"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # The critic (used by the PPO test only) learns faster than its LLM-sized defaults allow.
    config = load_config(None, ["algorithm.adv_estimator=gae", "rollout.replicas=2", "rollout.seed=3",
                                "trainer.progress_bar=false",
                                "weight_sync.timeout_s=20", "critic.lr=1e-3", "critic.ppo_micro_batch_size_per_gpu=512",
                                "critic.forward_micro_batch_size_per_gpu=512"])
    with LocalMesh(config, tmp_path_factory.mktemp("e2e") / "mesh") as mesh:
        yield mesh


def coordinator(mesh) -> CoordinatorClient:
    options = dataclasses.replace(ChannelOptions.from_config(mesh.config), timeout_s=300)
    return CoordinatorClient(mesh.endpoints["coordinator"][0]["grpc"], options)


async def run_to_end(mesh, overrides: list[str],
                     timeout_s: float = 400) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
    if not any(o.startswith("algorithm.adv_estimator=") for o in overrides):
        overrides = [GRPO, *overrides]
    async with coordinator(mesh) as client:
        await client.start_run(overrides)
        async with asyncio.timeout(timeout_s):
            async for _ in client.stream_metrics(timeout_s=timeout_s):
                pass
        return await client.run_status()


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollouts_of(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_the_quickstart_grpo_run_learns_the_task_and_syncs_every_step(mesh, experiment_dir):
    """`make run`'s training (the built-in config, all its steps) on this mesh: the warm-started model
    copies a random letter of the prompt (score ~1/6); GRPO must teach it to pick the vowel."""
    status = asyncio.run(run_to_end(mesh, [f"trainer.experiment_name={experiment_dir.name}"]))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    records = metrics_of(experiment_dir)
    steps = load_config(None).trainer.total_steps
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    scores = [r["critic/score/mean"] for r in records]
    assert scores[0] < 0.3, scores
    assert sum(scores[-3:]) / 3 > 0.8, scores
    assert all(0 <= r["critic/score/mean"] <= 1 for r in records)
    assert any(r["actor/grad_norm"] > 0 for r in records)  # a step whose samples all score 0 has no gradient
    # Every step synced new weights to both replicas, and the samples came from the policy being trained.
    versions = [int(r["rollout/weight_version"]) for r in records]
    assert versions == list(range(versions[0], versions[0] + steps))
    assert all(r["weight_sync/replicas"] == 2 for r in records)
    for step in (1, steps):
        assert {s["weight_version"] for s in rollouts_of(experiment_dir, step)} == {versions[step - 1] - 1}
    assert {"actor/pg_loss", "actor/grad_norm", "timing_s/gen", "timing_s/update", "perf/throughput"} <= set(records[-1])
    assert (experiment_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_short_ppo_run_with_gae_trains_the_critic_and_improves_reward(mesh, experiment_dir):
    steps = 12
    status = asyncio.run(run_to_end(mesh, [
        f"trainer.experiment_name={experiment_dir.name}", f"trainer.total_steps={steps}", "algorithm.adv_estimator=gae"]))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    records = metrics_of(experiment_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    scores = [r["critic/score/mean"] for r in records]
    last3 = sum(scores[-3:]) / 3
    assert last3 > 0.8 and last3 - scores[0] > 0.5, scores
    assert records[-1]["critic/vf_loss"] < records[0]["critic/vf_loss"]
    assert {"critic/vf_loss", "critic/values/mean", "critic/vf_explained_var"} <= set(records[-1])
    assert records[0]["critic/values/mean"] != records[-1]["critic/values/mean"]  # the critic was updated


def test_async_mode_trains_on_samples_at_most_one_version_old(mesh, experiment_dir):
    steps = 5
    started = time.monotonic()
    status = asyncio.run(run_to_end(mesh, [f"trainer.experiment_name={experiment_dir.name}", f"trainer.total_steps={steps}",
                                           "trainer.mode=async", "trainer.max_staleness=1"]))
    wall = time.monotonic() - started
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    records = metrics_of(experiment_dir)
    synced = [int(r["rollout/weight_version"]) for r in records]  # after step k: the policy of step k + 1
    start = synced[0] - 1  # the run's starting weights
    versions = {step: {s["weight_version"] for s in rollouts_of(experiment_dir, step)} for step in range(1, steps + 1)}
    # Step k's batch starts generating once step k-2's weights are synced, while step k-1 trains: by the
    # weights before step k-1's update, or (a sample that waited for the sync of step k-1) the ones after it.
    assert versions[1] == {start}
    for step in range(2, steps + 1):
        assert versions[step] <= {start + step - 2, start + step - 1}, (step, versions[step])
    assert max(r["rollout/staleness/max"] for r in records) == 1
    # Step times are wall time between step ends: the overlapped generation is not counted twice.
    assert sum(r["timing_s/step"] for r in records) < wall


def test_run_control_pause_checkpoint_stop_and_bad_requests(mesh, experiment_dir):
    async def scenario():
        async with coordinator(mesh) as client:
            for bad, refusal in ((["actor.lr=1"], InvalidArgument),
                                 (["trainer.total_steps=0"], InvalidArgument),
                                 (["data.train_files=[nonexistent.parquet]"], InvalidArgument),
                                 (["data.train_files=[/etc/passwd]"], PermissionDenied)):
                with pytest.raises(refusal):
                    await client.start_run(bad)
            await client.start_run([GRPO, f"trainer.experiment_name={experiment_dir.name}", "trainer.total_steps=50"])
            with pytest.raises(FailedPrecondition, match="one run at a time"):
                await client.start_run([f"trainer.experiment_name={experiment_dir.name}"])
            await client.pause_run()

            async def paused():
                status = await client.run_status()
                return status if status.state == coordinator_pb2.RUN_STATE_PAUSED else None

            status = await wait_until_async(paused, 60, "the run to pause at a step boundary")
            assert status.phase == "paused"
            await asyncio.sleep(1.0)  # not a wait for an event: the window in which no step may end
            assert (await client.run_status()).step == status.step  # no step while paused
            await client.resume_run()
            saved = await client.save_checkpoint()
            assert Path(saved.path).name == f"global_step_{saved.step}"
            assert (Path(saved.path) / "actor" / "model.safetensors").exists()
            await client.stop_run(skip_checkpoint=True)
            status = await client.run_status()
            assert status.state == coordinator_pb2.RUN_STATE_STOPPED
            assert status.step < 50

    asyncio.run(scenario())


def test_a_rollout_replica_killed_mid_run_is_dropped_and_the_run_finishes(mesh, experiment_dir):
    steps = 4
    victim = next(p for p in mesh.processes if p.name == "rollout-1")

    async def scenario():
        async with coordinator(mesh) as client:
            await client.start_run([GRPO, f"trainer.experiment_name={experiment_dir.name}", f"trainer.total_steps={steps}"])
            async with asyncio.timeout(300):
                async for update in client.stream_metrics(timeout_s=300):
                    if update.step == 1:
                        os.kill(victim.process.pid, signal.SIGKILL)
            return await client.run_status()

    status = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    records = metrics_of(experiment_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["weight_sync/replicas"] == 1
