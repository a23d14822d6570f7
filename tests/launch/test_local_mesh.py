"""`rlfabric up` with the built-in default: the lean quickstart mesh (actor, rollout, reward,
coordinator: GRPO without a KL term needs no critic and no reference) on loopback, each SERVING,
listing its services through reflection and exposing RPC metrics; a run that needs a role the mesh
lacks is refused naming it; every RPC needs the mesh's token (RUN_DIR/auth_token, 0600); SIGTERM
tears it all down (no orphans)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.mesh_access import mesh_channel

pytestmark = pytest.mark.slow

SERVICE_OF_ROLE = {
    "actor": "rlfabric.v1.ActorService",
    "reference": "rlfabric.v1.ReferenceService",
    "critic": "rlfabric.v1.CriticService",
    "rollout": "rlfabric.v1.RolloutService",
    "reward": "rlfabric.v1.RewardService",
    "coordinator": "rlfabric.v1.CoordinatorService",
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mesh") / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "up", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    output: list[str] = []
    # A thread drains the launcher's output so the test never blocks on (or races) the pipe.
    drain = threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True)
    drain.start()
    endpoints_file = run_dir / "endpoints.json"
    deadline = time.monotonic() + 300
    endpoints = {}
    # The launcher prints "mesh ready" once every service reported readiness SERVING.
    while "coordinator" not in endpoints or not any("mesh ready" in line for line in output):
        if launcher.poll() is not None:
            drain.join(timeout=10)  # the rest of its output
            pytest.fail(f"rlfabric up exited {launcher.returncode}: {''.join(output)}")
        assert time.monotonic() < deadline, "mesh did not come up in 300 s"
        if endpoints_file.exists():
            endpoints = json.loads(endpoints_file.read_text())
        time.sleep(0.2)
    yield launcher, run_dir, endpoints
    if launcher.poll() is None:
        launcher.kill()


def test_the_quickstart_roles_are_ready_and_reflect_their_services(mesh):
    _, run_dir, endpoints = mesh
    assert set(endpoints) == {"actor", "rollout", "reward", "coordinator"}
    assert not (run_dir / "logs" / "critic.log").exists() and not (run_dir / "logs" / "reference.log").exists()
    for role, entries in endpoints.items():
        for entry in entries:
            with grpc.insecure_channel(entry["grpc"]) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING, role
                reflected = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                names = {s.name for r in reflected for s in r.list_services_response.service}
                assert SERVICE_OF_ROLE[role] in names
            metrics = urllib.request.urlopen(f"http://{entry['metrics']}/metrics", timeout=5).read().decode()
            assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health"' \
                   in metrics, role
            assert (run_dir / "logs" / f"{entry['name']}.log").exists()


def test_the_mesh_start_is_recorded_phase_by_phase_and_the_coordinator_is_ready_with_its_tokenizer(mesh):
    _, run_dir, _ = mesh
    record = json.loads((run_dir / "mesh_start.json").read_text())
    phases = record["phases"]
    assert [p["name"] for p in phases] == ["placement", "model_build", "model_check", "workers_bound",
                                           "coordinator_bound", "readiness"]
    for before, after in itertools.pairwise(phases):  # one after the other, no gap nobody logged
        assert before["start_s"] + before["seconds"] <= after["start_s"]
    assert record["total_s"] >= phases[-1]["start_s"] + phases[-1]["seconds"]
    assert record["unaccounted_s"] < max(0.5, 0.05 * record["total_s"])
    # The coordinator checked the model and loaded its tokenizer before it reported ready.
    events = [json.loads(line)["event"] for line in (run_dir / "logs" / "coordinator.log").read_text().splitlines()
              if line.startswith("{")]
    loaded = events.index(next(e for e in events if e.startswith("coordinator start: tokenizer took")))
    assert any(e.startswith("coordinator start: model_check took") for e in events[:loaded])
    assert loaded < events.index("ready")


def test_coordinator_knows_every_role_address(mesh):
    import yaml

    _, run_dir, endpoints = mesh
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    for role in ("actor", "rollout", "reward"):
        assert resolved["cluster"][role] == [e["grpc"] for e in endpoints[role]]
    assert resolved["cluster"]["critic"] == [] and resolved["cluster"]["reference"] == []


@pytest.mark.parametrize("overrides, role, key", [
    (["algorithm.adv_estimator=gae"], "critic", "algorithm.adv_estimator=gae"),
    (["algorithm.use_kl_in_reward=true"], "reference", "algorithm.use_kl_in_reward=true"),
])
def test_a_run_that_needs_a_role_the_mesh_lacks_is_refused_naming_it(mesh, overrides, role, key):
    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

    _, run_dir, endpoints = mesh
    with mesh_channel(endpoints["coordinator"][0]["grpc"], run_dir) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            request = coordinator_pb2.CoordinatorServiceStartRunRequest(
                overrides=[*overrides, "trainer.experiment_name=x"])
            stub.StartRun(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{key} needs a {role} service" in refused.value.details()
        status = stub.GetRunStatus(coordinator_pb2.CoordinatorServiceGetRunStatusRequest(), timeout=10)
        assert status.state == coordinator_pb2.RUN_STATE_UNSPECIFIED  # nothing started


def test_status_command_reaches_the_coordinator(mesh):
    _, run_dir, _ = mesh
    out = subprocess.run([sys.executable, "-m", "rlfabric", "status", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"phase": "idle"}  # no run started yet: the other fields at their defaults
    # By address: with the token file it answers; without, the coordinator refuses and status says so.
    address = json.loads((run_dir / "endpoints.json").read_text())["coordinator"][0]["grpc"]
    status = [sys.executable, "-m", "rlfabric", "status", "--address", address]
    out = subprocess.run([*status, "--token-file", str(run_dir / "auth_token")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout) == {"phase": "idle"}, out.stderr
    out = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("rlfabric status: UNAUTHENTICATED"), out.stderr


def test_every_rpc_needs_the_mesh_token_which_only_its_user_can_read(mesh):
    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

    _, run_dir, endpoints = mesh
    token_file = run_dir / "auth_token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert len(token_file.read_text().strip()) >= 32
    for role, entries in endpoints.items():
        with grpc.insecure_channel(entries[0]["grpc"]) as channel:
            # Health stays open (probes); every service of the role refuses a call without the token.
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                                timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            method = f"/{SERVICE_OF_ROLE[role]}/GetStatus" if role != "coordinator" else \
                "/rlfabric.v1.CoordinatorService/GetRunStatus"
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(method)(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, role
    with mesh_channel(endpoints["coordinator"][0]["grpc"], run_dir) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        assert stub.GetRunStatus(coordinator_pb2.CoordinatorServiceGetRunStatusRequest(), timeout=10).phase == "idle"


def test_one_run_at_a_time_and_an_async_stop_keeps_every_trained_step(mesh):
    """Two StartRuns at once: one runs, the other is FAILED_PRECONDITION. StopRun (which saves by
    default) in async mode, where the next batch is already drawn, from a caller that gives up at once:
    the run still stops with a checkpoint whose data position is that of the first untrained batch, and
    the final model is exported."""
    import concurrent.futures

    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

    _, run_dir, endpoints = mesh
    batch = 64  # the quickstart's
    experiment = run_dir / "experiments" / "async-stop"
    overrides = ["trainer.experiment_name=async-stop", "trainer.total_steps=200", "trainer.mode=async",
                 "trainer.plot=false"]
    with mesh_channel(endpoints["coordinator"][0]["grpc"], run_dir) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)

        def start():
            try:
                stub.StartRun(coordinator_pb2.CoordinatorServiceStartRunRequest(overrides=overrides), timeout=120)
                return "started"
            except grpc.RpcError as error:
                return error.code(), error.details()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda _: start(), range(2)))
        assert outcomes.count("started") == 1, outcomes
        refused = next(o for o in outcomes if o != "started")
        assert refused[0] == grpc.StatusCode.FAILED_PRECONDITION and "one run at a time" in refused[1]

        for update in stub.StreamMetrics(coordinator_pb2.CoordinatorServiceStreamMetricsRequest(), timeout=300):
            if update.step >= 2:
                break
        # A StopRun whose caller gives up at once: the stop and its checkpoint still happen.
        # (A step, its checkpoint and the export take longer than the 0.5 s it waits.)
        try:
            stub.StopRun(coordinator_pb2.CoordinatorServiceStopRunRequest(), timeout=0.5)
        except grpc.RpcError as gave_up:
            assert gave_up.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        request = coordinator_pb2.CoordinatorServiceStreamMetricsRequest(from_step=10**6)
        for _ in stub.StreamMetrics(request, timeout=300):
            pass  # the stream ends when the run does
        status = stub.GetRunStatus(coordinator_pb2.CoordinatorServiceGetRunStatusRequest(), timeout=10)
    assert status.state == coordinator_pb2.RUN_STATE_STOPPED and status.step >= 2
    latest = experiment / "checkpoints" / f"global_step_{status.step}"
    state = json.loads((latest / "coordinator.json").read_text())
    assert state["step"] == status.step
    # The prefetched batch is drawn again on resume. A gen batch whose last groups were dropped as stale (they
    # started more than max_staleness versions behind; a continuing run never trains them either) counts as
    # consumed, so then the resume may start one batch later.
    metrics = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    dropped = sum(m.get("rollout/stale_groups", 0) for m in metrics if m["step"] <= status.step)
    allowed = {status.step * batch} | ({(status.step + 1) * batch} if dropped else set())
    assert state["data_position"] in allowed, (state["data_position"], dropped)
    assert (experiment / "final_model" / "model.safetensors").exists()


def test_train_attaches_to_a_running_mesh_and_stop_ends_its_run(mesh):
    """What the Helm chart's run Job and a laptop through a port-forward run: `rlfabric train --coordinator`
    with the mesh's config (addresses, token) waits for every service, starts the run and prints a line per
    step; `rlfabric stop --coordinator --token-file` ends a run with a checkpoint."""
    _, run_dir, endpoints = mesh
    address = endpoints["coordinator"][0]["grpc"]
    attach = [sys.executable, "-m", "rlfabric", "train", "--coordinator", address, str(run_dir / "config.resolved.yaml")]
    done = subprocess.run([*attach, "trainer.total_steps=2", "trainer.experiment_name=attached", "trainer.plot=false"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "rlfabric: waiting for 4 services to be ready"  # coordinator, actor, rollout, reward
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/2", "2/2"], lines
    assert "critic/score/mean=" in lines[-2] and lines[-1].endswith("RUN_STATE_COMPLETED at step 2")
    assert (run_dir / "experiments" / "attached" / "checkpoints" / "global_step_2").is_dir()

    long_run = subprocess.Popen([*attach, "trainer.total_steps=500", "trainer.experiment_name=stopped",
                                 "trainer.plot=false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in long_run.stdout:
            if line.startswith("step 1/500"):
                break
        stop = [sys.executable, "-m", "rlfabric", "stop", "--coordinator", address]
        refused = subprocess.run(stop, capture_output=True, text=True, timeout=60)  # no token
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        stopped = subprocess.run([*stop, "--token-file", str(run_dir / "auth_token")], capture_output=True,
                                 text=True, timeout=300)
        assert stopped.returncode == 0, stopped.stderr
        assert "RUN_STATE_STOPPED" in stopped.stdout
        assert long_run.wait(120) == 1  # the attached train reports a run that did not complete
    finally:
        long_run.kill()
    step = int(stopped.stdout.split()[-1])
    assert (run_dir / "experiments" / "stopped" / "checkpoints" / f"global_step_{step}").is_dir()


def test_sigterm_tears_down_every_service(mesh):
    launcher, _, endpoints = mesh
    pids = [e["pid"] for entries in endpoints.values() for e in entries]
    assert all(_alive(pid) for pid in pids)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []
