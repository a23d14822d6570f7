"""The Ray launcher at 32 nodes x 8 GPUs on a simulated Ray cluster: placement as configured, and a sim run.

    python -m bench.ray_scale_bench                 # make bench BENCH=ray_scale: bench/results/ray_scale.json
    python -m bench.ray_scale_bench --nodes 4 --run-nodes 4   # what tests/deploy/test_ray_scale.py runs

ray.cluster_utils.Cluster starts a real GCS and one real raylet per node on this machine, each node with 8
logical GPUs (Ray's num_gpus is a count it schedules by; nothing touches a device). The layout, for N nodes:
the actor (a simulated trainer) on a pool of one node, the reference on another, and the rollout on the other
N - 2 nodes, 8 simulated replicas of one GPU each per node; the reward service and the coordinator reserve
CPUs only. Two phases:
- placement, at --nodes: the launcher's own placement groups (pool_bundles, reserve_pools) reserved on the
  cluster, and checked per node against the pools: each pool on as many distinct nodes as it says, each of its
  bundles holding its GPUs per node, no node's GPUs reserved twice, and every service (launch.ray_placement)
  asking for its own GPUs on its pool's node;
- a run, at --run-nodes: RayMesh starts that layout's services (a process per trainer; with rollout.engine
  sim one process per node serves that node's replicas) and a few sim steps run to the end. The same checks
  then hold for the processes Ray placed: the node each reports, the GPU ids Ray assigned it.
Why the run is smaller than the placement here: a raylet with its two agents adds ~230 MB (32 of them: 7.9 GB of
the machine's used memory) and a service process with its Ray worker ~130 MB, so the 32-node run needs about 12 GB,
more than this 2-core, 24 GB machine shared with other work had free; the placement phase needs the raylets only.
A machine with the memory runs both at 32 (--run-nodes 32); a MemoryGuard fails the run, killing the cluster,
before it starves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

from rlfabric.core.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "ray_scale.json"
GPUS_PER_NODE = 8
NODE = {"num_cpus": 2, "num_gpus": GPUS_PER_NODE, "object_store_memory": 80 * 1024**2}
# Logical CPUs (Ray's scheduling labels: the nodes share this machine's 2 cores).
CPUS = {"actor": 0.5, "reference": 0.5, "rollout": 0.05, "reward": 0.25, "coordinator": 0.25}
SIM = [
    "rollout.engine=sim",
    "actor.engine=sim",
    "reference.engine=sim",
    "actor.use_kl_loss=true",
    "weight_sync.transport=grpc",
    "sim.time_scale=0.01",
    "sim.trainer.parameters=7000000000",
    "data.max_response_length=64",
    "rollout.n=4",
    "trainer.total_steps=2",
    "trainer.loggers=[jsonl]",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.save_final=false",
    "trainer.export_final=false",
    # Services on a multi-node cluster bind their node's address; these nodes are one machine's loopback.
    "server.allow_insecure=true",
    "launcher.startup_timeout_s=600",
]


def layout(nodes: int) -> list[str]:
    """The overrides of an N-node x 8-GPU layout: the actor's pool on one node, the reference's on one, the
    rollout's 8 replicas a node on the rest."""
    if nodes < 3:
        raise ValueError("the layout needs 3 nodes or more: the actor's, the reference's and a rollout node")
    rollout_nodes = nodes - 2
    return [
        f"resource_pools={{train: {{gpus: {GPUS_PER_NODE}}}, ref: {{gpus: {GPUS_PER_NODE}}}, "
        f"infer: {{gpus: {GPUS_PER_NODE}, nodes: {rollout_nodes}}}}}",
        "actor.pool=train",
        "reference.pool=ref",
        "rollout.pool=infer",
        f"rollout.replicas={rollout_nodes * GPUS_PER_NODE}",
        # A simulated trainer is one process; it holds its node's GPUs and models them (sim.trainer.gpus).
        f"launcher.ray.actor.num_gpus={GPUS_PER_NODE}",
        f"launcher.ray.reference.num_gpus={GPUS_PER_NODE}",
        f"sim.trainer.gpus={GPUS_PER_NODE}",
        f"data.train_batch_size={rollout_nodes * GPUS_PER_NODE}",
        f"actor.ppo_mini_batch_size={rollout_nodes * GPUS_PER_NODE}",
        *(f"launcher.ray.{role}.num_cpus={cpus}" for role, cpus in CPUS.items()),
    ]


def start_cluster(nodes: int):
    """A Ray cluster of `nodes` raylets of 8 logical GPUs on this machine, connected; (cluster, seconds)."""
    import ray
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    for _ in range(nodes - 1):
        cluster.add_node(**NODE)
    cluster.wait_for_nodes(timeout=600)
    ray.init(address=cluster.address)
    return cluster, time.monotonic() - started


def used_mb() -> float:
    """The machine's used memory (RSS double-counts the libraries every Ray process maps; this does not, but it
    counts the machine's other work too)."""
    return psutil.virtual_memory().used / 2**20


class MemoryGuard:
    """Kills this process's children (the cluster and its services) when the machine's available memory falls below
    `floor_mb`, so a run too big for the machine fails instead of starving the machine's other work."""

    def __init__(self, floor_mb: float = 1536):
        self.floor_mb, self.tripped = floor_mb, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            if psutil.virtual_memory().available / 2**20 < self.floor_mb:
                self.tripped = True
                for child in psutil.Process().children(recursive=True):
                    child.kill()
                return

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def cluster_rss_mb() -> float:
    """The resident memory of this process's children: the raylets, their agents, workers and services."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def pool_violations(config: RunConfig, groups: dict) -> list[str]:
    """What differs between the pools' placement groups on the cluster and what the pools say, per node."""
    from ray.util import placement_group_table

    from rlfabric.launch.ray_placement import pool_bundles

    wrong, gpus_on = [], defaultdict(float)
    for pool, specs in pool_bundles(config).items():
        table = placement_group_table(groups[pool])
        nodes = table["bundles_to_node_id"]
        spec = config.resource_pools[pool]
        if table["state"] != "CREATED" or len(set(nodes.values())) != spec.nodes:
            wrong.append(
                f"{pool}: {table['state']}, on {len(set(nodes.values()))} distinct nodes of {spec.nodes}"
            )
        for index, bundle in enumerate(specs):
            if bundle.get("GPU", 0) != spec.gpus_per_node:
                wrong.append(
                    f"{pool} bundle {index}: {bundle.get('GPU', 0)} GPUs, the pool says {spec.gpus_per_node}"
                )
            gpus_on[nodes[index]] += bundle.get("GPU", 0)
    wrong += [
        f"node {node[:8]}: {gpus:g} GPUs reserved of {GPUS_PER_NODE}"
        for node, gpus in gpus_on.items()
        if gpus > GPUS_PER_NODE
    ]
    return wrong


def service_violations(config: RunConfig, mesh) -> list[str]:
    """What each service asks Ray for against its pool: a trainer its node's GPUs, a replica one of its own."""
    from rlfabric.launch.local import service_names

    wrong = []
    for name, role in service_names(config):
        if not config.pool_of(role):
            continue
        asked = mesh.resources(name, role)["num_gpus"]
        own = GPUS_PER_NODE if role in ("actor", "reference") else config.rollout.tensor_parallel_size
        if asked != own:
            wrong.append(f"{name} asks for {asked:g} GPUs; its own are {own}")
    return wrong


def placed_violations(config: RunConfig, mesh) -> list[str]:
    """The processes Ray placed: each on its pool's node (the bundle the launcher chose), holding its GPUs, and no
    GPU id of a node held by two processes."""
    from ray.util import placement_group_table

    from rlfabric.launch.ray_placement import node_of

    wrong, held = [], defaultdict(list)
    for role, entries in mesh.endpoints.items():
        for entry in entries:
            if not config.pool_of(role):
                continue
            pool, bundle, _ = node_of(config, entry["name"], role)
            expected = placement_group_table(mesh.pools[pool])["bundles_to_node_id"][bundle]
            if entry["node_id"] != expected:
                wrong.append(f"{entry['name']} on node {entry['node_id'][:8]}, its bundle on {expected[:8]}")
            held[(entry["node_id"], entry["pid"])] = entry["gpu_ids"]  # a process serving several: once
    by_node = defaultdict(list)
    for (node, _), gpu_ids in held.items():
        by_node[node] += gpu_ids
    wrong += [
        f"node {node[:8]} GPU ids held twice: {sorted(ids)}"
        for node, ids in by_node.items()
        if len(ids) != len(set(ids))
    ]
    wrong += [
        f"node {node[:8]}: {len(ids)} GPU ids held, not {GPUS_PER_NODE}"
        for node, ids in by_node.items()
        if len(ids) != GPUS_PER_NODE
    ]
    return wrong


def placement(nodes: int) -> dict:
    """Phase 1: the layout's pools reserved on `nodes` raylets and checked, no service started."""
    import ray

    from rlfabric.launch.ray import RayMesh
    from rlfabric.launch.ray_placement import pool_bundles, reserve_pools

    config = load_config(None, [*SIM, *layout(nodes)])
    before = used_mb()
    cluster, up_s = start_cluster(nodes)
    try:
        rss, added = cluster_rss_mb(), used_mb() - before
        groups: dict = {}
        started = time.monotonic()
        reserve_pools(groups, pool_bundles(config), "ray-scale-bench", timeout_s=300)
        reserve_s = time.monotonic() - started
        mesh = RayMesh(config, Path(tempfile.mkdtemp(prefix="ray-scale-")))
        wrong = pool_violations(config, groups) + service_violations(config, mesh)
        alive = sum(1 for node in ray.nodes() if node["Alive"])
        for group in groups.values():
            ray.util.remove_placement_group(group)
        return {
            "nodes": nodes,
            "alive_nodes": alive,
            "gpus": ray.cluster_resources().get("GPU", 0),
            "cluster_up_s": round(up_s, 1),
            "cluster_rss_mb": round(rss),
            "rss_mb_per_node": round(rss / nodes),
            "used_mb_added": round(added),
            "reserve_s": round(reserve_s, 2),
            "pools": {p: len(s) for p, s in pool_bundles(config).items()},
            "replicas": config.rollout.replicas,
            "violations": wrong,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def sim_run(nodes: int, model_path: str | None = None) -> dict:
    """Phase 2: RayMesh starts the layout's services on `nodes` raylets and a sim run goes to its end."""
    import ray

    from rlfabric.cli.train import _run_training_at
    from rlfabric.core.client import ChannelOptions
    from rlfabric.launch.ray import RayMesh
    from rlfabric.launch.ray_placement import pool_bundles

    run_dir = Path(tempfile.mkdtemp(prefix="ray-scale-run-")) / "run"
    model = [f"model.path={model_path}"] if model_path else []
    config = load_config(None, [*SIM, *layout(nodes), *model])
    before = used_mb()
    cluster, up_s = start_cluster(nodes)
    try:
        started = time.monotonic()
        with MemoryGuard() as guard, RayMesh(config, run_dir) as mesh:
            start_s = time.monotonic() - started
            rss, added = cluster_rss_mb(), used_mb() - before
            wrong = pool_violations(config, mesh.pools) + service_violations(config, mesh)
            wrong += placed_violations(config, mesh)
            coordinator = mesh.endpoints["coordinator"][0]["grpc"]
            started = time.monotonic()
            status = asyncio.run(_run_training_at(coordinator, ChannelOptions.from_config(config), config))
            run_s = time.monotonic() - started
            processes = len(
                {(e["node_id"], e["pid"]) for entries in mesh.endpoints.values() for e in entries}
            )
        if guard.tripped:
            raise MemoryError(f"{nodes} nodes: the machine's available memory fell below {guard.floor_mb} MB")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        from rlfabric.v1 import coordinator_pb2

        return {
            "nodes": nodes,
            "cluster_up_s": round(up_s, 1),
            "mesh_start_s": round(start_s, 1),
            "run_s": round(run_s, 1),
            "cluster_rss_mb": round(rss),
            "used_mb_added": round(added),
            "service_processes": processes,
            "pools": {p: len(s) for p, s in pool_bundles(config).items()},
            "replicas": config.rollout.replicas,
            "completed": status.state == coordinator_pb2.RUN_STATE_COMPLETED,
            "error": status.error,
            "steps": [r["step"] for r in records],
            "simulated": [r.get("sim/simulated") for r in records],
            "delivered_samples": [r.get("rollout/router/delivered_samples") for r in records],
            "samples_per_step": config.data.train_batch_size * config.rollout.n,
            "violations": wrong,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32, help="raylets of the placement phase")
    parser.add_argument("--run-nodes", type=int, default=8, help="raylets of the sim run (0: no run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30),
            "platform": platform.platform(),
        },
        "gpus_per_node": GPUS_PER_NODE,
        "placement": placement(args.nodes),
    }
    print(json.dumps(result["placement"], indent=1), flush=True)
    if args.run_nodes:
        result["run"] = sim_run(args.run_nodes)
        print(json.dumps(result["run"], indent=1), flush=True)
    result["load_average"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
