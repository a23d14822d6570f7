"""Resource pools: the config names them and checks them at load, the local launcher gives each pool's
services its GPUs (CUDA_VISIBLE_DEVICES) and cores (CPU affinity, read back from /proc), and
`rlfabric up --dry-run` prints the placement without starting anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlfabric.core.config import ConfigError, load_config, load_run_config
from rlfabric.launch.local import LocalMesh, service_names
from rlfabric.launch.placement import placed_devices, plan_placement, predicted_transport

pytestmark = pytest.mark.slow

TWO_POOLS = ["resource_pools={train: {gpus: 2}, infer: {devices: [0]}}", "actor.pool=train", "actor.world_size=2",
             "rollout.pool=infer", "rollout.replicas=2"]


def test_a_role_naming_an_unknown_pool_is_an_error_naming_the_key_and_the_pools():
    with pytest.raises(ConfigError, match=r"rollout.pool: no resource pool 'gpu' \(resource_pools: train\)"):
        load_config(None, ["resource_pools={train: {gpus: 1}}", "rollout.pool=gpu"])


def test_a_pool_too_small_for_a_world_size_is_an_error_naming_both():
    with pytest.raises(ConfigError, match=r"resource_pools.train has 2 GPU\(s\), too few for critic.world_size 4"):
        load_config(None, ["resource_pools={train: {gpus: 1, nodes: 2}}", "critic.pool=train", "critic.world_size=4"])


def test_gpus_and_devices_of_a_pool_must_agree():
    with pytest.raises(ConfigError, match=r"resource_pools.p: .*gpus 2 disagrees with devices \[3\]"):
        load_config(None, ["resource_pools={p: {gpus: 2, devices: [3]}}"])


def test_pools_get_their_gpus_and_roles_share_them_inside_a_pool():
    config = load_config(None, TWO_POOLS)
    placements = plan_placement(config, service_names(config), gpu_count=3)
    # infer names GPU 0, so train's two GPUs are the next free ones.
    assert placements["actor"].gpus == (1, 2)
    assert placements["rollout-0"].gpus == placements["rollout-1"].gpus == (0,)
    assert placements["reward"].gpus is None  # no pool: every GPU, as without pools
    assert placements["actor"].env()["CUDA_VISIBLE_DEVICES"] == "1,2"


def test_pool_indices_count_the_gpus_the_launcher_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    config = load_config(None, TWO_POOLS)
    placements = plan_placement(config, service_names(config), gpu_count=3)
    assert placements["actor"].env()["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert placements["rollout-1"].env()["CUDA_VISIBLE_DEVICES"] == "4"


@pytest.mark.parametrize("overrides, message", [
    (TWO_POOLS, r"resource_pools.train needs GPU\(s\) \[1, 2\]; this machine has 2"),
    (["resource_pools={p: {nodes: 2}}", "actor.pool=p"], r"resource_pools.p.nodes 2: the local launcher runs on one node"),
    (["resource_pools={p: {cpus: [4096]}}"], r"resource_pools.p.cpus \[4096\]: not cores this launcher may use"),
])
def test_pools_this_machine_cannot_hold_are_refused_before_anything_starts(overrides, message):
    config = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message):
        plan_placement(config, service_names(config), gpu_count=2)


def _rlfabric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfabric", *args], capture_output=True, text=True, timeout=120)


def test_dry_run_prints_the_placement_and_starts_nothing(tmp_path):
    result = _rlfabric("up", "--dry-run", "--run-dir", str(tmp_path / "run"),
                       "resource_pools={train: {cpus: [0]}, infer: {cpus: [1]}}", "actor.pool=train",
                       "rollout.pool=infer", "rollout.replicas=2", "env.enable=true", "env.pool=infer")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "pool train: GPUs none, CPUs 0, nodes 1; roles: actor" in lines
    assert "pool infer: GPUs none, CPUs 1, nodes 1; roles: env, rollout" in lines
    rows = {line.split()[0]: line.split()[1:] for line in lines if not line.startswith("pool ")}
    # Two rollout replicas share pool infer's one core; the coordinator has the launcher's cores to itself.
    assert rows["rollout-1"] == ["pool", "infer", "GPUs", "none", "(CPU)", "CPUs", "1", "threads", "1"]
    assert rows["env"][:6] == ["pool", "infer", "GPUs", "none", "(CPU)", "CPUs"]  # no torch: no share of threads
    assert rows["coordinator"] == ["pool", "-", "GPUs", "all", "CPUs", "any", "threads",
                                   str(len(os.sched_getaffinity(0)))]
    assert not (tmp_path / "run").exists()


def test_dry_run_says_when_this_machine_cannot_hold_the_pools():
    result = _rlfabric("up", "--dry-run", *TWO_POOLS)
    assert result.returncode == 1
    assert "actor        pool train  GPUs 1-2" in result.stdout
    assert "this machine cannot run it with the local launcher: resource_pools.train needs" in result.stdout


def test_dry_run_for_ray_prints_a_placement_group_per_pool():
    pytest.importorskip("ray")
    result = _rlfabric("up", "--dry-run", "--launcher", "ray", *TWO_POOLS)
    assert result.returncode == 0, result.stderr
    assert "ray placement group train: bundles [{'CPU': 1.0, 'GPU': 2.0}]" in result.stdout
    assert "ray placement group infer: bundles [{'CPU': 2.0, 'GPU': 1.0}]" in result.stdout  # two replicas


def _proc_status(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as status:
        return next(line.split(":", 1)[1].strip() for line in status if line.startswith(field + ":"))


def _proc_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        entries = environ.read().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


TWO_CORES = len(os.sched_getaffinity(0)) >= 2
# Pool train (core 0) holds the actor, pool infer (core 1) the rollout replicas; the rest have no pool.
PINNED = ["resource_pools={train: {cpus: [0]}, infer: {cpus: [1]}}", "actor.pool=train", "rollout.pool=infer"]


@pytest.fixture(scope="module")
def live_mesh(tmp_path_factory):
    """One LocalMesh for the tests that read its processes' affinity and environment (a mesh boot is the cost
    of this module): PPO (a critic) with two rollout replicas, and, on a machine with two cores, PINNED's pools.
    Yields the mesh's config and each process's pid, Cpus_allowed_list and environment, read while it runs."""
    config = load_run_config(None, ["algorithm.adv_estimator=gae", "rollout.replicas=2",
                                    *(PINNED if TWO_CORES else [])])
    # Without the test processes' own OMP_WAIT_POLICY (tests/conftest.py), so that the services' is the launcher's.
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("OMP_WAIT_POLICY", raising=False)
        with LocalMesh(config, tmp_path_factory.mktemp("placement") / "run") as mesh:
            processes = {proc.name: {"pid": proc.process.pid, "environ": _proc_environ(proc.process.pid),
                                     "cpus": _proc_status(proc.process.pid, "Cpus_allowed_list")}
                         for proc in mesh.processes}
    return config, processes


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores to give two pools one each")
def test_the_local_launcher_pins_each_pool_to_its_cores(live_mesh):
    _, processes = live_mesh
    assert processes["actor"]["cpus"] == "0"
    assert processes["rollout-0"]["cpus"] == processes["rollout-1"]["cpus"] == "1"
    # No pool: the launcher's cores and GPUs.
    assert processes["reward"]["cpus"] == _proc_status(os.getpid(), "Cpus_allowed_list")
    actor_env = processes["actor"]["environ"]
    assert actor_env["CUDA_VISIBLE_DEVICES"] == ""  # a pool without GPUs hides them
    assert actor_env["OMP_NUM_THREADS"] == "1"
    assert processes["reward"]["environ"].get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


SPLIT = ["resource_pools={train: {gpus: 1}, infer: {gpus: 1}}", "actor.pool=train", "rollout.pool=infer"]
SHARED = ["resource_pools={shared: {gpus: 1}}", "actor.pool=shared", "rollout.pool=shared"]


@pytest.mark.parametrize("overrides, gpu_count, visible, transport, reason", [
    ([], 1, None, "cuda_ipc", "the actor and rollout-0 share GPU 0"),  # one GPU, the defaults: both take cuda:0
    ([], 0, None, "gloo", "the actor is on CPU"),
    (SPLIT, 2, None, "nccl", "every member holds a GPU of its own"),
    (SPLIT, 2, "GPU-aa,GPU-bb", "nccl", "every member holds a GPU of its own"),
    (SHARED, 1, None, "cuda_ipc", "the actor and rollout-0 share GPU 0"),
    ([*SPLIT, "rollout.replicas=2"], 2, None, "gloo", "rollout-0 and rollout-1 share GPU 1"),
    (["resource_pools={train: {gpus: 1}}", "actor.pool=train"], 2, "5,7", "cuda_ipc",  # the rollout sees every GPU
     "the actor and rollout-0 share GPU 5"),
    (["resource_pools={cpu: {cpus: [0]}}", "actor.pool=cpu", "rollout.pool=cpu"], 1, None, "gloo",
     "the actor is on CPU"),
])
def test_the_local_launcher_predicts_the_transport_from_the_gpus_it_gives(overrides, gpu_count, visible, transport,
                                                                          reason, monkeypatch):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = load_config(None, overrides)
    placements = plan_placement(config, service_names(config), gpu_count)
    choice = predicted_transport(config, placed_devices(config, placements, gpu_count))
    assert (choice.transport, choice.reason) == (transport, reason)


def test_nccl_forced_onto_one_gpu_is_refused_before_any_service_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = load_config(None, ["weight_sync.transport=nccl"])
    with pytest.raises(ConfigError, match="weight_sync.transport nccl cannot run on these devices: the actor and "
                                          "rollout-0 share GPU 0"):
        predicted_transport(config, placed_devices(config, plan_placement(config, service_names(config), 1), 1))
    # This machine has no GPU: the local launcher refuses it before it starts anything.
    with pytest.raises(ConfigError, match="weight_sync.transport nccl needs every member on a GPU"):
        with LocalMesh(load_run_config(None, ["weight_sync.transport=nccl"]), tmp_path / "run"):
            pass
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, transport, reason", [
    ([], "nccl", "every member holds a GPU of its own"),  # a whole GPU each
    (SHARED, "cuda_ipc", "the actor and rollout-0 share GPU 0 of resource pool shared"),
    (["launcher.ray.rollout.num_gpus=0"], "gloo", "rollout-0 is on CPU"),
    (["rollout.engine=sglang"], "nccl", "rollout-0 did not report its GPU; the resource pools keep them apart"),
])
def test_the_ray_launcher_predicts_the_transport_from_what_it_reserves(overrides, transport, reason):
    ray_launcher = pytest.importorskip("rlfabric.launch.ray_placement")
    def choice(config, cluster_has_gpus: bool):
        return predicted_transport(config, ray_launcher.reserved_devices(config, cluster_has_gpus))

    with_gpus = choice(load_config(None, overrides), cluster_has_gpus=True)
    assert (with_gpus.transport, with_gpus.reason) == (transport, reason)
    without_gpus = choice(load_config(None, overrides), cluster_has_gpus=False)
    assert (without_gpus.transport, without_gpus.reason) == ("gloo", "the actor is on CPU")
    with pytest.raises(ConfigError, match="weight_sync.transport nccl cannot run on these devices"):
        choice(load_config(None, [*SHARED, "weight_sync.transport=nccl"]), True)


def test_services_get_the_planned_threads_and_idle_openmp_threads_that_sleep(live_mesh):
    config, processes = live_mesh
    planned = {name: p.env()["OMP_NUM_THREADS"] for name, p in plan_placement(config, service_names(config)).items()}
    environs = {name: process["environ"] for name, process in processes.items()}
    assert {"critic", "rollout-1", "coordinator"} <= environs.keys()
    assert {name: environs[name]["OMP_NUM_THREADS"] for name in planned} == planned
    assert {env.get("OMP_WAIT_POLICY") for env in environs.values()} == {"PASSIVE"}


ALL_ON_FOUR_CORES = ["resource_pools={all: {cpus: [0, 1, 2, 3]}}", "actor.pool=all", "rollout.pool=all",
                     "reference.pool=all", "critic.pool=all"]


def _threads(overrides: list[str]) -> dict[str, str]:
    config = load_run_config(None, [*ALL_ON_FOUR_CORES, *overrides])
    return {name: p.env()["OMP_NUM_THREADS"] for name, p in plan_placement(config, service_names(config)).items()}


def test_services_that_take_turns_each_get_the_cores_and_services_that_overlap_share_them():
    # The quickstart's shape (actor, one replica): in sync mode they take turns, so each has the four cores.
    launcher_cores = str(len(os.sched_getaffinity(0)))  # the reward service is in no pool: the launcher's cores
    assert _threads([]) == {"actor": "4", "rollout-0": "4", "reward": launcher_cores}
    # Sync: the two replicas generate together, then actor, reference and critic compute together.
    both = ["rollout.replicas=2", "actor.use_kl_loss=true", "algorithm.adv_estimator=gae"]
    sync = _threads(both)
    torch_services = ("rollout-0", "rollout-1", "actor", "reference", "critic")
    assert {name: sync[name] for name in torch_services} == {
        "rollout-0": "2", "rollout-1": "2", "actor": "1", "reference": "1", "critic": "1"}
    # Async: generation goes on while the trainers train, so all five share the four cores.
    assert {_threads([*both, "trainer.mode=async"])[name] for name in torch_services} == {"1"}
    assert _threads(["trainer.mode=async"]) == {"actor": "2", "rollout-0": "2", "reward": launcher_cores}
    # The hybrid engine takes turns too: the colocated rollout sleeps while the actor trains.
    assert _threads(["trainer.colocated=true"])["actor"] == "4"


def test_the_launcher_environment_keeps_its_own_openmp_wait_policy(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    config = load_run_config(None, [])
    assert all("OMP_WAIT_POLICY" not in p.env() for p in plan_placement(config, service_names(config)).values())


def test_threads_per_service_overrides_the_share_and_a_pools_cores_are_shared_by_its_torch_services():
    pinned = load_run_config(None, ["resource_pools={train: {cpus: [0, 1]}}", "actor.pool=train",
                                    "algorithm.adv_estimator=gae", "critic.pool=train", "reward.pool=train"])
    placements = plan_placement(pinned, service_names(pinned))
    assert placements["actor"].env()["OMP_NUM_THREADS"] == "1"  # two cores, two torch services
    assert placements["reward"].env()["OMP_NUM_THREADS"] == "1"
    # The only torch service left on the launcher's cores has them all.
    assert placements["rollout-0"].env()["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    fixed = load_run_config(None, ["launcher.threads_per_service=3"])
    assert {p.env()["OMP_NUM_THREADS"] for p in plan_placement(fixed, service_names(fixed)).values()} == {"3"}
