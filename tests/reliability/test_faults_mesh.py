"""Fault injection on a live local mesh (every role its own process, two rollout replicas): what real
clusters do to a long run, and what the run must do about it.

- a rollout replica killed mid-generation: the run goes on; restarted on its address, it rejoins
  (weight sync, router) with the current weights and serves again;
- the reward service killed and restarted mid-step: scoring retries; no sample lost or scored twice;
- a frozen (SIGSTOP) reward service: deadlines fire and the run's error names the role, its address
  and DEADLINE_EXCEEDED, in bounded time;
- the actor killed: the run fails in bounded time naming the actor; restarted, the same run resumes
  from its last checkpoint with the data order and steps of an uninterrupted run;
- the coordinator process killed (the services keep running): the same, after restarting it;
- a full disk under the actor's checkpoint write (RLIMIT_FSIZE on the actor process, which makes
  writes past the limit fail with EFBIG as a full disk fails them with ENOSPC): a clear error and the
  previous checkpoint intact.

One mesh for the module; every test starts and ends with every service running (`coordinator`
restarts what a failed test left dead or stopped). Weight sync across replicas: tests/weight_sync.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlfabric.coordinator.checkpoints import checkpoint_root, latest_checkpoint, read_state
from rlfabric.core.config import load_config
from rlfabric.core.host import load_tokenizer
from rlfabric.core.server import ServerOptions
from rlfabric.data.dataset import RLHFDataset
from rlfabric.launch.local import LocalMesh, ServiceProcess
from rlfabric.reward import compute_score
from rlfabric.serve import build_service
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.mesh_access import mesh_channel

pytestmark = pytest.mark.slow

BATCH, N = 4, 2  # prompts per step, samples per prompt
ACTIVE = (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_PAUSED)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = load_config(None, [
        "rollout.replicas=2", "rollout.seed=3", f"rollout.n={N}", f"data.train_batch_size={BATCH}",
        f"actor.ppo_mini_batch_size={BATCH}", f"critic.ppo_mini_batch_size={BATCH}", "weight_sync.timeout_s=20",
        "trainer.progress_bar=false", "trainer.plot=false"])
    with LocalMesh(config, tmp_path_factory.mktemp("faults") / "mesh") as mesh:
        yield mesh


class Coordinator:
    """Blocking CoordinatorService calls: the test's main thread also kills and starts processes
    (a child of the launcher dies with the thread that started it)."""

    def __init__(self, address: str, run_dir: Path):
        self.address = address
        self.channel = mesh_channel(address, run_dir)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def start(self, *overrides: str) -> coordinator_pb2.CoordinatorServiceStartRunResponse:
        request = coordinator_pb2.CoordinatorServiceStartRunRequest(overrides=list(overrides))
        return self.stub.StartRun(request, timeout=180)

    def status(self) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        return self.stub.GetRunStatus(coordinator_pb2.CoordinatorServiceGetRunStatusRequest(), timeout=10,
                                      wait_for_ready=True)

    def wait(self, what: str, until, timeout_s: float = 120) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        """Polls GetRunStatus until `until(status)`; fails if the run ends first or it takes too long."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if until(status):
                return status
            assert status.state in ACTIVE, (f"the run ended {coordinator_pb2.RunState.Name(status.state)} "
                                            f"({status.error}) while waiting for {what}")
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s (step {status.step}, {status.phase})"
            time.sleep(0.05)

    def wait_end(self, timeout_s: float = 180) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        return self.wait("end of the run", lambda s: s.state not in ACTIVE, timeout_s)

    def stop_if_running(self) -> None:
        try:
            if self.status().state in ACTIVE:
                self.stub.StopRun(coordinator_pb2.CoordinatorServiceStopRunRequest(skip_checkpoint=True), timeout=120)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.channel.close()


def service(mesh: LocalMesh, name: str) -> ServiceProcess:
    return next(p for p in mesh.processes if p.name == name)


def heal(mesh: LocalMesh) -> None:
    """Every service of the mesh running again: SIGCONT the stopped, restart the dead."""
    for proc in mesh.processes:
        if proc.process.poll() is None:
            os.kill(proc.process.pid, signal.SIGCONT)
            lift_file_size_limit(proc)
    for proc in list(mesh.processes):
        if proc.process.poll() is not None:
            mesh.restart(proc.name)


@pytest.fixture
def coordinator(mesh):
    """The mesh's coordinator with every service up and no run in progress, before and after the test."""
    heal(mesh)
    client = Coordinator(service(mesh, "coordinator").grpc_address, mesh.run_dir)
    yield client
    client.close()
    heal(mesh)
    after = Coordinator(service(mesh, "coordinator").grpc_address, mesh.run_dir)
    after.stop_if_running()
    after.close()


def limit_file_size(proc: ServiceProcess, max_bytes: int) -> None:
    """RLIMIT_FSIZE (the soft limit, so it can be lifted again): a write past max_bytes fails with EFBIG
    (Python ignores SIGXFSZ), as writes fail on a full disk."""
    resource.prlimit(proc.process.pid, resource.RLIMIT_FSIZE, (max_bytes, resource.RLIM_INFINITY))


def lift_file_size_limit(proc: ServiceProcess) -> None:
    resource.prlimit(proc.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def kill(proc: ServiceProcess) -> None:
    proc.process.send_signal(signal.SIGKILL)
    proc.process.wait(timeout=30)


def run_overrides(run_dir: Path, steps: int, *more: str) -> list[str]:
    return [f"trainer.experiment_name={run_dir.name}", f"trainer.total_steps={steps}", "trainer.loggers=[jsonl]", *more]


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollouts_of(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def assert_every_sample_once(run_dir: Path, step: int) -> list[dict]:
    """BATCH prompts x N samples, each (prompt uid, sample index) exactly once."""
    rows = rollouts_of(run_dir, step)
    keys = Counter((r["uid"], r["sample_index"]) for r in rows)
    uids = {uid for uid, _ in keys}
    assert len(rows) == BATCH * N and len(uids) == BATCH, f"step {step}: {len(rows)} samples of {len(uids)} prompts"
    assert set(keys) == {(uid, i) for uid in uids for i in range(N)} and max(keys.values()) == 1, f"step {step}: {keys}"
    return rows


def expected_uids(mesh: LocalMesh, run_dir: Path, steps: int, seed: int) -> dict[int, list[str]]:
    """The prompts of each step in an uninterrupted run: the dataset's seeded order, batch by batch."""
    data = RLHFDataset([run_dir / "data" / "find_vowel" / "train.parquet"], load_tokenizer(mesh.config.model.path),
                       max_prompt_length=mesh.config.data.max_prompt_length)
    order = data.epoch_order(0, seed)
    return {step: [data.rows[i].uid for i in order[(step - 1) * BATCH : step * BATCH]] for step in range(1, steps + 1)}


def assert_like_an_uninterrupted_run(mesh: LocalMesh, run_dir: Path, steps: int, seed: int) -> None:
    """Steps 1..steps once each (resumed steps replaced), each on the batch an uninterrupted run draws."""
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, steps + 1))
    expected = expected_uids(mesh, run_dir, steps, seed)
    for step in range(1, steps + 1):
        rows = assert_every_sample_once(run_dir, step)
        assert [r["uid"] for r in rows[::N]] == expected[step], f"step {step} trained on other prompts"


def stall_mid_generation(coordinator: Coordinator, victim: ServiceProcess, other: ServiceProcess) -> int:
    """Freezes `victim` (SIGSTOP) while it holds an unfinished generate request of a step after the
    first; returns that step. A freeze that came too late (the step moved on) is undone and tried again."""
    # Generation takes well under a second here: freeze as soon as a step starts generating (one
    # GetRunStatus per poll, nothing slower), then check that the step is waiting for the victim alone.
    for _ in range(60):
        step = coordinator.wait("a step generating", lambda s: s.step >= 1 and s.phase == "generating").step + 1
        os.kill(victim.process.pid, signal.SIGSTOP)
        time.sleep(1.0)  # a step's generation takes well under a second here
        status = coordinator.status()
        if status.step == step - 1 and status.phase == "generating" and not generating(other):
            return step  # the step waits for the frozen replica alone
        os.kill(victim.process.pid, signal.SIGCONT)
    pytest.fail("never caught the replica in the middle of a generate request")


def checkpointed(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0: none)."""
    path = latest_checkpoint(run_dir)
    return read_state(path).step if path else 0


def rollout_weight_version(address: str, run_dir: Path) -> int:
    with mesh_channel(address, run_dir) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10).weight_version


def rpc_counts(proc: ServiceProcess, method: str) -> tuple[float, float]:
    """(started, handled) calls of one method, from the service's /metrics."""
    with urllib.request.urlopen(f"http://{proc.host}:{proc.ports['metrics']}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts = {"grpc_server_started_total": 0.0, "grpc_server_handled_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counts and sample.labels.get("grpc_method") == method:
                counts[sample.name] += sample.value
    return counts["grpc_server_started_total"], counts["grpc_server_handled_total"]


def generating(proc: ServiceProcess) -> bool:
    started, handled = rpc_counts(proc, "GenerateStream")
    return started > handled


def log_since(path: Path, offset: int) -> str:
    with open(path, errors="replace") as log:
        log.seek(offset)
        return log.read()


# --- rollout --------------------------------------------------------------------------------------


def test_a_rollout_replica_killed_mid_generation_rejoins_when_restarted(mesh, coordinator, experiment_dir):
    victim = service(mesh, "rollout-1")
    address, other = victim.grpc_address, service(mesh, "rollout-0").grpc_address
    log = mesh.run_dir / "logs" / "coordinator.log"
    offset = log.stat().st_size
    # Steps of this tiny mesh take tens of milliseconds: the run must outlast the replica's restart
    # (StopRun ends it).
    coordinator.start(*run_overrides(experiment_dir, 100_000))
    killed_in = stall_mid_generation(coordinator, victim, service(mesh, "rollout-0"))
    kill(victim)
    # The run goes on with the other replica: the killed step's samples are generated there.
    coordinator.wait("two steps without the replica", lambda s: s.step >= killed_in + 1)
    restarted = mesh.restart("rollout-1")
    assert restarted.grpc_address == address and restarted.process.pid != victim.process.pid
    back = coordinator.wait("the replica back in the weight sync",
                            lambda s: s.last_metrics.get("weight_sync/replicas") == 2, 120).step
    coordinator.wait("two steps with it", lambda s: s.step >= back + 2)
    coordinator.stub.PauseRun(coordinator_pb2.CoordinatorServicePauseRunRequest(), timeout=10)
    paused = coordinator.wait("pause", lambda s: s.state == coordinator_pb2.RUN_STATE_PAUSED)
    # It serves the current weights, and the router sends it work again.
    assert rollout_weight_version(address, mesh.run_dir) == paused.weight_version == rollout_weight_version(other, mesh.run_dir)
    assert rpc_counts(restarted, "GenerateStream")[0] > 0, "the restarted replica never generated"
    coordinator.stub.StopRun(coordinator_pb2.CoordinatorServiceStopRunRequest(skip_checkpoint=True), timeout=60)

    records = metrics_of(experiment_dir)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    replicas = {r["step"]: r["weight_sync/replicas"] for r in records}
    assert replicas[killed_in - 1] == 2 and replicas[killed_in] == replicas[killed_in + 1] == 1
    assert replicas[back] == replicas[len(records)] == 2
    # Its unfinished requests went to the other replica: the killed step has every sample.
    assert f'"rollout replica out", "address": "{address}"' in log_since(log, offset)
    for step in (killed_in, back + 1):
        assert_every_sample_once(experiment_dir, step)


# --- reward ---------------------------------------------------------------------------------------


def test_the_reward_service_restarted_mid_step_loses_and_repeats_no_sample(mesh, coordinator, experiment_dir):
    steps = 6
    log = mesh.run_dir / "logs" / "coordinator.log"
    offset = log.stat().st_size
    coordinator.start(*run_overrides(experiment_dir, steps))
    # Killed once step 1 is done, whatever phase the next step is in (a tiny step's generation can be
    # shorter than a poll): the steps after it must score on a dead, then restarted, service.
    coordinator.wait("step 1 done", lambda s: s.step >= 1)
    kill(service(mesh, "reward"))
    deadline = time.monotonic() + 60
    while "reward scoring failed" not in log_since(log, offset):  # this step's Score met the dead service
        assert time.monotonic() < deadline, "the coordinator never retried scoring"
        time.sleep(0.1)
    mesh.restart("reward")
    status = coordinator.wait_end()
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert [r["step"] for r in metrics_of(experiment_dir)] == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        for row in assert_every_sample_once(experiment_dir, step):
            assert row["score"] == compute_score(row["data_source"], row["response"], row["ground_truth"]), row


# --- a slow service -------------------------------------------------------------------------------


def test_a_frozen_reward_service_fires_deadlines_and_the_run_names_it(mesh, coordinator, experiment_dir, serve_in_thread):
    timeout_s = 4.0
    # A second coordinator on this mesh whose calls have a short deadline (client.timeout_s is fixed
    # when a coordinator starts; StartRun cannot change it).
    config = load_config(mesh.run_dir / "config.resolved.yaml", [f"client.timeout_s={timeout_s}"])
    fast = Coordinator(serve_in_thread(build_service("coordinator", config),
                                       ServerOptions(port=0, metrics_port=None)).address, mesh.run_dir)
    reward = service(mesh, "reward")
    fast.start(*run_overrides(experiment_dir, 3))
    os.kill(reward.process.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        status = fast.wait_end(timeout_s=150)
    finally:
        os.kill(reward.process.pid, signal.SIGCONT)
        fast.close()
    waited = time.monotonic() - frozen
    assert status.state == coordinator_pb2.RUN_STATE_FAILED
    assert status.step == 0
    # A missed deadline is retried once, after 1 s (Peers.score), then the run fails.
    assert waited < 2 * timeout_s + 1 + 30, f"the run took {waited:.0f} s to notice"
    for part in ("reward", reward.grpc_address, "DEADLINE_EXCEEDED", f"{timeout_s:g} s"):
        assert part in status.error, f"{part!r} not in {status.error!r}"


# --- the actor and the coordinator ----------------------------------------------------------------


def test_a_killed_actor_fails_the_run_clearly_and_the_rerun_resumes(mesh, coordinator, experiment_dir):
    steps, seed = 6, 5
    overrides = run_overrides(experiment_dir, steps, "trainer.save_freq=1", f"data.seed={seed}")
    actor = service(mesh, "actor")
    coordinator.start(*overrides)
    coordinator.wait("a checkpoint of step 2+", lambda s: checkpointed(experiment_dir) >= 2)
    kill(actor)
    killed = time.monotonic()
    status = coordinator.wait_end(timeout_s=120)
    waited = time.monotonic() - killed
    assert status.state == coordinator_pb2.RUN_STATE_FAILED
    assert waited < 60, f"the run took {waited:.0f} s to fail"
    assert "actor" in status.error and actor.grpc_address in status.error, status.error

    mesh.restart("actor")
    resumed = coordinator.start(*overrides)
    assert resumed.start_step == read_state(latest_checkpoint(experiment_dir)).step >= 2
    status = coordinator.wait_end()
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert_like_an_uninterrupted_run(mesh, experiment_dir, steps, seed)


def test_a_killed_coordinator_restarts_and_the_rerun_resumes(mesh, coordinator, experiment_dir):
    steps, seed = 6, 6
    overrides = run_overrides(experiment_dir, steps, "trainer.save_freq=1", f"data.seed={seed}")
    coordinator.start(*overrides)
    coordinator.wait("a checkpoint of step 2+", lambda s: checkpointed(experiment_dir) >= 2)
    kill(service(mesh, "coordinator"))
    assert [p.name for p in mesh.failed()] == ["coordinator"]  # the services keep running

    restarted = Coordinator(mesh.restart("coordinator").grpc_address, mesh.run_dir)
    try:
        resumed = restarted.start(*overrides)
        assert resumed.start_step == read_state(latest_checkpoint(experiment_dir)).step >= 2
        status = restarted.wait_end()
    finally:
        restarted.close()
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert_like_an_uninterrupted_run(mesh, experiment_dir, steps, seed)


# --- checkpoints ----------------------------------------------------------------------------------


def test_a_full_disk_during_a_checkpoint_is_a_clear_error_and_keeps_the_previous_one(mesh, coordinator, experiment_dir):
    coordinator.start(*run_overrides(experiment_dir, 1, "trainer.save_freq=1"))
    assert coordinator.wait_end().state == coordinator_pb2.RUN_STATE_COMPLETED
    previous = latest_checkpoint(experiment_dir)
    files = {p: p.read_bytes() for p in previous.rglob("*") if p.is_file()}
    assert previous.name == "global_step_1" and previous / "actor" / "model.safetensors" in files

    # The actor may write its log on, but no file past 64 KiB: its model file does not fit.
    actor = service(mesh, "actor")
    limit = actor.log_path.stat().st_size + (64 << 10)
    assert len(files[previous / "actor" / "model.safetensors"]) > limit
    limit_file_size(actor, limit)
    try:
        coordinator.start(*run_overrides(experiment_dir, 3, "trainer.save_freq=1"))
        status = coordinator.wait_end()
    finally:
        lift_file_size_limit(actor)
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and status.step == 2
    assert "checkpoint" in status.error and "File too large" in status.error, status.error
    # The previous checkpoint is intact and still the resume point; nothing half-written is left.
    assert latest_checkpoint(experiment_dir) == previous
    assert {p: p.read_bytes() for p in previous.rglob("*") if p.is_file()} == files
    assert sorted(p.name for p in checkpoint_root(experiment_dir).iterdir()) == ["global_step_1",
                                                                           "latest_checkpointed_iteration.txt"]

    resumed = coordinator.start(*run_overrides(experiment_dir, 3, "trainer.save_freq=1"))
    assert resumed.start_step == 1
    assert coordinator.wait_end().state == coordinator_pb2.RUN_STATE_COMPLETED
    assert [r["step"] for r in metrics_of(experiment_dir)] == [1, 2, 3]
    assert latest_checkpoint(experiment_dir).name == "global_step_3"
