"""What the Ray launcher asks for at scale, without a cluster: replicas of one role side by side on a node each
hold GPUs of their own, roles colocated in a pool share, sim replicas of one node are served by one process, and
the coordinator asks for no GPU on a cluster that has them."""

from __future__ import annotations

import pytest

from rlfabric.cli import main
from rlfabric.core.config import load_config
from rlfabric.launch.local import service_names
from rlfabric.launch.ray_placement import (
    pool_bundles,
    pool_gpu_share,
    requested_gpus,
    reserved_devices,
    rollout_hosts,
)

NODE_OF_8 = [
    "resource_pools={train: {gpus: 8}, infer: {gpus: 8, nodes: 3}}",
    "actor.pool=train",
    "rollout.pool=infer",
    "rollout.replicas=24",
    "launcher.ray.actor.num_gpus=8",
]


def rollouts(config):
    return [(name, role) for name, role in service_names(config) if role == "rollout"]


def test_replicas_of_one_gpu_fill_a_node_of_eight_each_on_its_own():
    config = load_config(None, NODE_OF_8)
    assert pool_bundles(config) == {
        "train": [{"CPU": 1.0, "GPU": 8.0}],
        "infer": [{"CPU": 8.0, "GPU": 8.0}] * 3,
    }
    assert {pool_gpu_share(config, name, role, 1) for name, role in rollouts(config)} == {1}
    _, replicas = reserved_devices(config, cluster_has_gpus=True)
    assert replicas["rollout-4"].gpu == "0 of rollout-4"  # its own device, no other replica's
    # Nine replicas on a node of 8 would not fit side by side: they share, as before.
    crowded = load_config(
        None, ["resource_pools={infer: {gpus: 8}}", "rollout.pool=infer", "rollout.replicas=9"]
    )
    assert pool_gpu_share(crowded, "rollout-0", "rollout", 1) == pytest.approx(1 / 9)


def test_roles_colocated_in_a_pool_still_share_its_gpus():
    config = load_config(
        None, ["resource_pools={shared: {gpus: 2}}", "actor.pool=shared", "rollout.pool=shared"]
    )
    assert pool_gpu_share(config, "rollout-0", "rollout", 1) == 0.5
    actor, replicas = reserved_devices(config, cluster_has_gpus=True)
    assert actor.gpu == replicas["rollout-0"].gpu == "0 of resource pool shared"


def test_sim_replicas_of_one_node_are_served_by_one_process():
    config = load_config(None, [*NODE_OF_8, "rollout.engine=sim", "actor.engine=sim"])
    hosts = rollout_hosts(config, rollouts(config))
    assert [[name for name, _ in host] for host in hosts] == [
        [f"rollout-{node + 3 * i}" for i in range(8)] for node in range(3)
    ]  # replica i on node i mod 3
    assert rollout_hosts(load_config(None, NODE_OF_8), rollouts(config)) == [
        [r] for r in rollouts(config)
    ]  # not sim


def test_the_coordinator_asks_for_no_gpu_on_a_gpu_cluster():
    config = load_config(None, NODE_OF_8)
    assert requested_gpus(config, "coordinator", cluster_has_gpus=True) == 0
    assert requested_gpus(config, "rollout", cluster_has_gpus=True) == 1


def test_serve_refuses_a_stride_below_one():
    with pytest.raises(SystemExit, match="--replica-stride must be >= 1"):
        main(
            [
                "serve",
                "rollout",
                "rollout.engine=sim",
                "--replicas",
                "2",
                "--replica-stride",
                "0",
                "--port-file",
                "p-{replica}.json",
            ]
        )
