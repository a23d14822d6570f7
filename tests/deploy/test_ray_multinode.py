"""A resource pool across two Ray nodes (`resource_pools.<pool>.nodes: 2`) on a two-node Ray cluster on this machine.

ray.cluster_utils.Cluster starts a real GCS and two real raylets: node A (the head, at the host's address) and
node B (at 127.0.0.2, so its services bind and advertise an address of their own), each with one logical CPU.
Placement groups, STRICT_SPREAD and node ids are Ray's own; what the two nodes share is this machine's cores and
its filesystem (RUN_DIR, as a cluster shares it through a volume). Each node's placement is checked twice: by
Ray's word (the placement group table and the node id each service's Ray actor reports) and by the process tree
(the service process descends from that node's raylet, which started its actor's worker).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from rlfabric.cli.train import _run_training_at
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.launch.local import MeshStartError
from rlfabric.launch.ray import RayMesh
from rlfabric.rollout.client import RolloutClient
from rlfabric.v1 import coordinator_pb2
from tests.pki import TestCA

pytestmark = pytest.mark.slow

NODE_B_ADDRESS = "127.0.0.2"
NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}  # a scheduling label: the nodes share the cores
# Half a node for each service of the pool, the rest for the reward and the coordinator.
CPUS = {"actor": 0.5, "rollout": 0.5, "reward": 0.25, "coordinator": 0.25}
SPREAD_POOL = ["resource_pools={spread: {nodes: 2}}", "actor.pool=spread", "rollout.pool=spread"]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _raylet_above(pid: int, raylets: dict[int, str]) -> str | None:
    """The node id of the raylet (raylet pid -> node id) that `pid` descends from, if any."""
    while pid > 1:
        if pid in raylets:
            return raylets[pid]
        pid = _parent(pid)
    return None


@pytest.fixture(scope="module")
def two_nodes():
    """The cluster, connected: {"raylets": {raylet pid: node id}, "addresses": {node id: address}}."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"node_a": 1}})
    node_b = cluster.add_node(**NODE, resources={"node_b": 1}, node_ip_address=NODE_B_ADDRESS)
    try:
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address)
        nodes = [cluster.head_node, node_b]
        yield {"raylets": {n.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: n.node_id
                           for n in nodes},
               "addresses": {n.node_id: n.node_ip_address for n in nodes}, "head": cluster.head_node.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def overrides(two_nodes, tiny_model, tmp_path_factory) -> list[str]:
    """The tiny model, small reservations and TLS: services on a multi-node cluster bind their node's address,
    where `rlfabric serve` refuses to run without TLS (one certificate naming both nodes' addresses here)."""
    folder = tmp_path_factory.mktemp("model")
    model = tiny_model  # the session's: the services only read it
    ca = TestCA()
    cert, key = ca.issue([*two_nodes["addresses"].values(), "127.0.0.1"])
    for name, pem in (("cert.pem", cert), ("key.pem", key), ("ca.pem", ca.pem)):
        (folder / name).write_bytes(pem)
    return [f"model.path={model}", "launcher.startup_timeout_s=240", "data.max_response_length=8",
            f"server.tls.cert_file={folder / 'cert.pem'}", f"server.tls.key_file={folder / 'key.pem'}",
            f"server.tls.ca_file={folder / 'ca.pem'}",
            *(f"launcher.ray.{role}.num_cpus={cpus}" for role, cpus in CPUS.items())]


@pytest.fixture(scope="module")
def spread_mesh(two_nodes, overrides, tmp_path_factory):
    """The quickstart (actor, rollout, reward, coordinator) with the actor and its rollout replica in one pool of two
    nodes; its endpoints.json entries by service name."""
    run_dir = tmp_path_factory.mktemp("ray-2-nodes") / "run"
    config = load_config(None, [*overrides, *SPREAD_POOL, "trainer.total_steps=2"])
    with RayMesh(config, run_dir) as mesh:
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        yield mesh, {entry["name"]: entry for entries in endpoints.values() for entry in entries}


def test_a_two_node_pool_places_its_services_on_both_nodes(two_nodes, spread_mesh):
    mesh, services = spread_mesh
    table = placement_group_table(mesh.pools["spread"])
    assert (table["strategy"], table["state"]) == ("STRICT_SPREAD", "CREATED")
    bundle_nodes = table["bundles_to_node_id"]
    assert set(bundle_nodes.values()) == set(two_nodes["addresses"])  # one bundle on each node
    # The pool's i-th service in bundle i: the actor on one node, its rollout replica on the other.
    assert services["actor"]["node_id"] == bundle_nodes[0]
    assert services["rollout-0"]["node_id"] == bundle_nodes[1]
    assert services["coordinator"]["node_id"] == two_nodes["head"]  # the launcher's node, where RUN_DIR is
    for name in ("actor", "rollout-0", "coordinator"):
        node = services[name]["node_id"]
        # Not only Ray's word: the service process runs under that node's raylet ...
        assert _raylet_above(services[name]["pid"], two_nodes["raylets"]) == node, name
        # ... and serves on that node's address.
        assert services[name]["grpc"].rpartition(":")[0] == two_nodes["addresses"][node], name


def test_a_run_completes_with_its_weight_sync_group_across_the_nodes(spread_mesh):
    mesh, services = spread_mesh
    assert services["actor"]["node_id"] != services["rollout-0"]["node_id"]
    run_dir = mesh.run_dir
    options = ChannelOptions.from_config(mesh.config)
    started = time.monotonic()
    status = asyncio.run(_run_training_at(services["coordinator"]["grpc"], options, mesh.config))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    print(f"two steps on two nodes in {time.monotonic() - started:.1f} s")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    events = [json.loads(line) for line in (run_dir / "logs" / "coordinator.log").read_text().splitlines()
              if line.startswith("{")]
    groups = [e for e in events if e.get("event") == "weight-sync group built"]
    # One gloo group of the actor (rank 0, on one node) and rollout-0 (rank 1, on the other), by address.
    assert [(g["transport"], g["members"], g["failed"]) for g in groups] == [
        ("gloo", [services["rollout-0"]["grpc"]], {})]
    syncs = [e for e in events if e.get("event") == "weights synced"]
    assert syncs and all(s["failed"] == {} and s["bytes"] > 0 for s in syncs), syncs
    status = asyncio.run(_rollout_status(services["rollout-0"]["grpc"], options))
    assert status.weight_version == syncs[-1]["version"] > 0  # the replica on node B serves what node A sent


async def _rollout_status(address: str, options: ChannelOptions):
    async with RolloutClient(address, options) as client:
        return await client.status(timeout_s=30)


def test_a_pool_spanning_more_nodes_than_the_cluster_has_fails_the_start_naming_the_key(two_nodes, overrides,
                                                                                        tmp_path):
    config = load_config(None, [*overrides, "resource_pools={spread: {nodes: 3}}", "actor.pool=spread",
                                "rollout.pool=spread", "rollout.replicas=2",
                                "launcher.startup_timeout_s=2"])  # it cannot be met: wait little for it
    mesh = RayMesh(config, tmp_path / "three-nodes")  # a namespace of its own beside the module's mesh
    started = time.monotonic()
    with pytest.raises(MeshStartError, match=r"resource pool spread .* within 2 s: resource_pools.spread.nodes 3 "
                                             r"needs 3 distinct Ray nodes.*the cluster has 2 alive node\(s\)"):
        with mesh:
            pass
    assert time.monotonic() - started < 60
    assert mesh.services == []  # nothing was started
    # The pending group is removed, not left to hold the cluster's CPUs (and trigger autoscaling) for later runs.
    states = [group["state"] for group in placement_group_table().values()
              if group["name"] == f"{mesh.namespace}-spread"]
    assert states == ["REMOVED"]
