"""`rlfabric up --launcher ray`: every role as a Ray actor on a real local Ray instance (CPU), a generative judge's
pool (judge.model_path) among them.

One Ray instance serves the module. `rlfabric up --launcher ray --address ...` runs against it as a
subprocess (a KubeRay user's path); RayMesh runs in-process for the failure cases; `rlfabric up` without
--address starts and stops a private instance of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

# Ray on loopback only: this test cluster is one machine (Ray otherwise uses the host's network address).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import grpc  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import yaml  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from ray.util import placement_group_table  # noqa: E402

from rlfabric.core.config import load_config  # noqa: E402
from rlfabric.launch.local import MeshStartError  # noqa: E402
from rlfabric.launch.ray import RayMesh  # noqa: E402
from rlfabric.reward import find_vowel  # noqa: E402
from rlfabric.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc  # noqa: E402
from tests.judges import VOWEL_JUDGE, judge_model  # noqa: E402
from tests.mesh_access import mesh_channel  # noqa: E402

pytestmark = pytest.mark.slow

ROLES = {"actor", "reference", "critic", "rollout", "reward", "env", "judge", "coordinator"}
LEAN_ROLES = {"actor", "rollout", "reward", "coordinator"}  # the quickstart (GRPO, no KL term)
# PPO with a KL loss, multi-turn with the environment service: all seven roles.
EVERY_ROLE = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "env.enable=true", "data.builtin_task=lookup",
              "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=2"]
# The run the module trains on that mesh (`rlfabric train --coordinator`): two short steps.
SHORT_RUN = ["data.max_prompt_length=96", "data.max_response_length=24", "data.train_batch_size=8",
             "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "rollout.n=2",
             "trainer.loggers=[jsonl]", "trainer.total_steps=2"]
# Two resource pools (a placement group each) for three of the roles; the other three are placed freely.
POOL_OF = {"actor": "train", "reward": "train", "rollout": "infer"}
POOLS = ["resource_pools={train: {}, infer: {}}", *(f"{role}.pool={pool}" for role, pool in POOL_OF.items())]
CLUSTER_CPUS = 8
# Small CPU reservations (they are Ray's logical CPUs): every mesh of the module fits beside another.
CPUS = {"actor": 1.0, "reference": 0.5, "critic": 0.5, "rollout": 1.0, "reward": 0.25, "env": 0.25,
        "judge": 0.25, "coordinator": 0.25}
SMALL = [f"launcher.ray.{role}.num_cpus={cpus}" for role, cpus in CPUS.items()] + ["launcher.startup_timeout_s=240"]


# -- helpers -------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead for our purposes
    except (ProcessLookupError, FileNotFoundError):
        return False


def _descendants(root: int) -> set[int]:
    """Every process below root (services, Ray's raylet, GCS and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _wait_dead(pids, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _services_of(run_dir) -> list[int]:
    """`rlfabric serve` processes of this run (their --config lies in run_dir)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode(errors="replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        if "serve" in argv and any(str(run_dir) in arg for arg in argv) and _alive(int(entry)):
            found.append(int(entry))
    return found


def _actors_in(namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def _pids(endpoints) -> list[int]:
    return [e["pid"] for entries in endpoints.values() for e in entries]


class Launcher:
    """`rlfabric up|train --launcher ray ...` as a subprocess, its output collected by a thread."""

    def __init__(self, *args: str):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # only --address says where
        self.process = subprocess.Popen([sys.executable, "-m", "rlfabric", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def text(self) -> str:
        return "".join(self.output)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while "mesh ready" not in self.text():
            if self.process.poll() is not None:
                self._reader.join(5)
                pytest.fail(f"rlfabric exited {self.process.returncode}:\n{self.text()}")
            assert time.monotonic() < deadline, f"the mesh did not come up in {timeout} s:\n{self.text()}"
            time.sleep(0.2)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance for the module: the cluster `--address` points at."""
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, object_store_memory=100 * 1024**2)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def small(tiny_model) -> list[str]:
    """Overrides for the in-process meshes: small CPU reservations, the session's tiny model."""
    return [*SMALL, f"model.path={tiny_model}"]


@pytest.fixture(scope="module")
def cli_mesh(ray_address, tmp_path_factory):
    """`rlfabric up --launcher ray --address ADDR` with the quickstart config as multi-turn PPO with a KL loss:
    every role, three of them in two resource pools, and a judge pool that scores find_vowel items (not the run's:
    its lookup samples keep their rule). One mesh boot for the module's inspections, its training run and its
    SIGTERM (a boot is most of this module's time)."""
    run_dir = tmp_path_factory.mktemp("ray") / "run"
    judge = judge_model(tmp_path_factory.mktemp("judge") / "model")
    launcher = Launcher("up", "--launcher", "ray", "--address", ray_address, "--run-dir", str(run_dir), *SMALL,
                        *EVERY_ROLE, *SHORT_RUN, *POOLS, f"judge.model_path={judge}",
                        f"reward.judge.data_sources=[{find_vowel.DATA_SOURCE}]", *VOWEL_JUDGE)
    started = time.monotonic()
    launcher.wait_ready()
    print(f"ray mesh ready in {time.monotonic() - started:.1f} s")
    yield launcher, run_dir, json.loads((run_dir / "endpoints.json").read_text())
    launcher.kill()


# -- the mesh on an existing Ray cluster ---------------------------------------------------------


def test_endpoints_list_every_role_and_the_coordinator_knows_them(cli_mesh):
    _, run_dir, endpoints = cli_mesh
    assert set(endpoints) == ROLES
    for entries in endpoints.values():
        for entry in entries:
            assert entry["grpc"].startswith("127.0.0.1:"), entry  # one-node cluster: loopback
            assert (run_dir / "logs" / f"{entry['name']}.log").exists()
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    for role in ROLES - {"coordinator"}:
        assert resolved["cluster"][role] == [e["grpc"] for e in endpoints[role]]


def test_every_service_is_ready_over_grpc(cli_mesh):
    _, _, endpoints = cli_mesh
    for role, entries in endpoints.items():
        for entry in entries:
            with grpc.insecure_channel(entry["grpc"]) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, role


def test_reward_scores_through_its_judge_and_rollout_generates(cli_mesh):
    """The reward's config names the judge pool the launcher started, whose verdicts score find_vowel items."""
    _, run_dir, endpoints = cli_mesh
    resolved = load_config(run_dir / "config.resolved.yaml")
    assert resolved.reward.judge.addresses == [endpoints["judge"][0]["grpc"]]
    with mesh_channel(endpoints["reward"][0]["grpc"], run_dir) as channel:
        items = [reward_pb2.ScoreItem(data_source=find_vowel.DATA_SOURCE, response=r, ground_truth="E")
                 for r in ("E", "B")]
        results = reward_pb2_grpc.RewardServiceStub(channel).Score(
            reward_pb2.RewardServiceScoreRequest(items=items), timeout=60).results
    assert [(r.score, r.metrics["judge_failed"]) for r in results] == [(1.0, 0.0), (0.0, 0.0)], results
    with mesh_channel(endpoints["rollout"][0]["grpc"], run_dir) as channel:
        request = rollout_pb2.RolloutServiceGenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=[5, 6, 7])],
            sampling_params=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=0))
        samples = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(request, timeout=60).samples
    assert [s.sample_index for s in samples] == [0, 1]
    assert all(1 <= len(s.token_ids) <= 3 for s in samples)


def test_each_role_holds_the_resources_configured(cli_mesh):
    launcher, run_dir, endpoints = cli_mesh
    namespace = f"rlfabric-{run_dir.name}"
    names = {e["name"]: role for role, entries in endpoints.items() for e in entries}
    assert sorted(_actors_in(namespace)) == sorted(names)
    for name, role in names.items():
        actor = ray.get_actor(name, namespace=namespace)
        assert ray.get(actor.assigned_resources.remote(), timeout=30) == {"CPU": CPUS[role]}, name
    expected_free = CLUSTER_CPUS - sum(CPUS.values())
    deadline = time.monotonic() + 10  # the GCS's view of free resources trails a little
    while ray.available_resources().get("CPU") != expected_free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == expected_free


def weight_version(run_dir, address: str) -> int:
    with mesh_channel(address, run_dir) as channel:
        return rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(
            rollout_pb2.RolloutServiceGetStatusRequest(), timeout=30).weight_version


def _pools_of(namespace: str) -> dict[str, dict]:
    """{pool name: its placement group's entry in Ray's table} of the placement groups the mesh made."""
    return {entry["name"].removeprefix(f"{namespace}-"): entry for entry in placement_group_table().values()
            if entry["name"].startswith(f"{namespace}-") and entry["state"] != "REMOVED"}


def test_each_resource_pool_is_a_placement_group_holding_its_services(cli_mesh):
    _, run_dir, endpoints = cli_mesh
    namespace = f"rlfabric-{run_dir.name}"
    pools = _pools_of(namespace)
    assert set(pools) == {"train", "infer"} and {p["state"] for p in pools.values()} == {"CREATED"}
    # A bundle per node, holding what the pool's services reserve.
    assert pools["train"]["bundles"] == {0: {"CPU": CPUS["actor"] + CPUS["reward"]}}
    assert pools["infer"]["bundles"] == {0: {"CPU": CPUS["rollout"]}}
    for role, entries in endpoints.items():
        for entry in entries:
            actor = ray.get_actor(entry["name"], namespace=namespace)
            placed_in = ray.get(actor.placement_group_id.remote(), timeout=30)
            pool = POOL_OF.get(role)
            assert placed_in == (pools[pool]["placement_group_id"] if pool else None), entry["name"]


def test_a_multi_turn_run_trains_on_the_ray_mesh_and_reaches_the_env_it_starts(cli_mesh):
    """`rlfabric train --coordinator` runs two steps on the Ray mesh (what a KubeRay user's run Job runs). A rollout
    replica calls only an environment its own config names: the Ray launcher starts the env service first and the
    replicas once its address is their config's cluster.env, so every sample of the multi-turn run reaches it."""
    _, run_dir, endpoints = cli_mesh
    coordinator = endpoints["coordinator"][0]["grpc"]
    run = Launcher("train", "--coordinator", coordinator, "--token-file", str(run_dir / "auth_token"),
                   str(run_dir / "config.yaml"))
    assert run.process.wait(timeout=540) == 0, run.text()
    assert "COMPLETED at step 2" in run.text(), run.text()
    assert weight_version(run_dir, endpoints["rollout"][0]["grpc"]) > 0
    assert weight_version(run_dir, endpoints["judge"][0]["grpc"]) == 0  # weight syncs never reach the judge
    assert load_config(run_dir / "config.yaml").cluster.env == [endpoints["env"][0]["grpc"]]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert step["agent/env_failed/count"] == 0 and step["agent/turns/mean"] >= 1, step
        assert "critic/vf_loss" in step and "actor/kl_loss" in step, sorted(step)  # the critic and reference trained


def test_sigterm_stops_every_service_and_actor(cli_mesh):
    launcher, run_dir, endpoints = cli_mesh
    groups = [entry["placement_group_id"] for entry in _pools_of(f"rlfabric-{run_dir.name}").values()]
    assert len(groups) == 2
    pids = _pids(endpoints)
    assert all(_alive(pid) for pid in pids)
    launcher.process.send_signal(signal.SIGTERM)  # ray.init's own SIGTERM handler would exit at once
    assert launcher.process.wait(timeout=90) == 0, launcher.text()
    assert "stopping the mesh" in launcher.text()
    assert _wait_dead(pids) == []
    assert _services_of(run_dir) == []
    assert _actors_in(f"rlfabric-{run_dir.name}") == []
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != CLUSTER_CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == CLUSTER_CPUS  # every reservation released
    assert {placement_group_table()[group]["state"] for group in groups} == {"REMOVED"}


# -- failures ------------------------------------------------------------------------------------


def test_a_service_that_fails_to_load_is_named(ray_address, small, tmp_path):
    config = load_config(None, [*small, "reward.custom_path=/nonexistent/score.py"])
    mesh = RayMesh(config, tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(MeshStartError, match=r"^reward exited with code 1") as failure:
        with mesh:
            pass
    # It is reported as soon as it exits, not after the startup timeout (240 s) or the others' model loads.
    assert time.monotonic() - started < 120
    assert "custom reward file not found: '/nonexistent/score.py'" in str(failure.value)  # its log's tail
    assert _actors_in(mesh.namespace) == []
    assert _wait_dead(_services_of(tmp_path)) == []


def test_a_pool_reserves_its_gpus_per_node_and_its_services_share_them():
    from rlfabric.core.config import ConfigError
    from rlfabric.launch.ray_placement import pool_bundles, pool_gpu_share

    config = load_config(None, ["resource_pools={shared: {gpus: 1}, critic: {gpus: 2}}", "actor.pool=shared",
                                "rollout.pool=shared", "algorithm.adv_estimator=gae", "critic.pool=critic",
                                "critic.world_size=2", "launcher.ray.critic.num_cpus=4"])
    assert pool_bundles(config) == {"shared": [{"CPU": 2.0, "GPU": 1.0}], "critic": [{"CPU": 4.0, "GPU": 2.0}]}
    assert pool_gpu_share(config, "rollout-0", "rollout", 1) == 0.5  # the actor and the rollout: one GPU, half each
    assert pool_gpu_share(config, "critic", "critic", 2) == 2  # alone in its pool
    # One service cannot span nodes (its ranks run on its node): a critic alone in a two-node pool is refused.
    with pytest.raises(ConfigError, match=r"resource_pools.critic.nodes 2: the pool holds 1 service\(s\) \(critic\)"):
        pool_bundles(load_config(None, ["resource_pools={critic: {gpus: 1, nodes: 2}}", "algorithm.adv_estimator=gae",
                                        "critic.pool=critic", "critic.world_size=2"]))
    two_rank_actor = load_config(None, ["resource_pools={shared: {gpus: 2}}", "actor.pool=shared", "rollout.pool=shared",
                                        "actor.world_size=2"])
    with pytest.raises(ConfigError, match="actor.pool shared: a service on 2 GPUs cannot share a node of a pool"):
        pool_gpu_share(two_rank_actor, "actor", "actor", 2)


def test_a_multi_node_pool_puts_its_ith_service_on_node_i_mod_nodes():
    from rlfabric.core.config import ConfigError
    from rlfabric.launch.placement import predicted_transport
    from rlfabric.launch.ray_placement import pool_bundles, pool_gpu_share, pool_nodes, reserved_devices

    config = load_config(None, ["resource_pools={spread: {gpus: 1, nodes: 2}}", "actor.pool=spread",
                                "rollout.pool=spread", "rollout.replicas=3", "launcher.ray.rollout.num_cpus=0.5"])
    assert pool_nodes(config) == {"spread": [[("actor", "actor"), ("rollout-1", "rollout")],
                                             [("rollout-0", "rollout"), ("rollout-2", "rollout")]]}
    assert pool_bundles(config) == {"spread": [{"CPU": 1.5, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]}
    assert pool_gpu_share(config, "rollout-0", "rollout", 1) == 0.5  # shares node 1's GPU with rollout-2
    # The actor shares node 0's GPU with rollout-1 (same-device path); rollout-0 holds another node's GPU.
    assert predicted_transport(config, reserved_devices(config, cluster_has_gpus=True)).reason == (
        "the actor and rollout-1 share GPU 0 of node 0 of resource pool spread")
    apart = load_config(None, ["resource_pools={spread: {gpus: 1, nodes: 2}}", "actor.pool=spread", "rollout.pool=spread"])
    assert pool_gpu_share(apart, "actor", "actor", 1) == 1  # alone on its node: its own GPU
    assert predicted_transport(apart, reserved_devices(apart, cluster_has_gpus=True)).transport == "nccl"
    # Bad input, named by its key before anything starts.
    with pytest.raises(ConfigError, match=r"resource_pools.spread.nodes 3: the pool holds 2 service\(s\) "
                                          r"\(actor, rollout-0\) and each node of a pool runs at least one"):
        pool_nodes(load_config(None, ["resource_pools={spread: {nodes: 3}}", "actor.pool=spread", "rollout.pool=spread"]))
    wide_actor = load_config(None, ["resource_pools={spread: {gpus: 1, nodes: 2}}", "actor.pool=spread",
                                    "rollout.pool=spread", "actor.world_size=2"])
    with pytest.raises(ConfigError, match="resource_pools.spread.gpus 1 per node: actor needs 2 GPUs on one node"):
        pool_gpu_share(wide_actor, "actor", "actor", 2)


def test_a_service_ray_cannot_place_fails_within_the_startup_timeout(ray_address, small, tmp_path):
    # No GPU on this cluster: the reward service can never be placed.
    config = load_config(None, [*small, "launcher.ray.reward.num_gpus=1", "launcher.startup_timeout_s=10"])
    mesh = RayMesh(config, tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(MeshStartError, match=r"reward was not placed on the Ray cluster within 10 s.*'num_gpus': 1"):
        with mesh:
            pass
    assert time.monotonic() - started < 40
    assert _actors_in(mesh.namespace) == []
    assert _wait_dead(_services_of(tmp_path)) == []


def test_a_two_node_pool_on_a_one_node_cluster_fails_the_start_naming_the_key(ray_address, small, tmp_path):
    config = load_config(None, [*small, "resource_pools={spread: {nodes: 2}}", "actor.pool=spread",
                                "rollout.pool=spread", "launcher.startup_timeout_s=2"])  # it cannot be met: wait little
    mesh = RayMesh(config, tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(MeshStartError, match=r"resource pool spread .* within 2 s: resource_pools.spread.nodes 2 needs "
                                             r"2 distinct Ray nodes.*the cluster has 1 alive node\(s\)"):
        with mesh:
            pass
    assert time.monotonic() - started < 40
    assert mesh.services == [] and _actors_in(mesh.namespace) == []  # nothing was started


# -- a private local Ray instance ----------------------------------------------------------------


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_up_without_address_runs_its_own_ray_and_notices_a_lost_actor(ray_address, small, tmp_path):
    run_dir = tmp_path / "run"
    launcher = Launcher("up", "--launcher", "ray", "--run-dir", str(run_dir), *small)
    try:
        launcher.wait_ready()
        tree = _descendants(launcher.process.pid)  # its Ray instance (GCS, raylet, workers) and services
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        assert set(endpoints) == LEAN_ROLES  # the quickstart starts no critic and no reference
        assert set(_pids(endpoints)) <= tree
        assert _actors_in(f"rlfabric-{run_dir.name}") == []  # not on the module's cluster
        # The reward's Ray actor dies (as with a lost node): its service goes with it, the launcher
        # reports it and tears down the rest, its private Ray instance included.
        reward = endpoints["reward"][0]["pid"]
        os.kill(_parent(reward), signal.SIGKILL)
        assert launcher.process.wait(timeout=90) == 1, launcher.text()
        assert "reward lost its Ray actor" in launcher.text()
        assert _wait_dead(tree) == []
    finally:
        launcher.kill()
