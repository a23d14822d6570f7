"""Resource pools on a Ray cluster: which placement group bundle each service goes into, what it asks Ray for,
and reserving the groups (the Ray launcher's counterpart of rlfabric.launch.placement).

    pool_bundles(config)    # {"shared": [{"CPU": 2.0, "GPU": 1.0}]}: actor and rollout-0 on one GPU
    describe_pools(config)  # what `rlfabric up --launcher ray --dry-run` prints

Resource pools (resource_pools, <role>.pool): one placement group per pool, a bundle per node of the pool
(STRICT_SPREAD over distinct nodes when it has several). The pool's i-th service (start order: actor,
reference, critic, rollout-0, rollout-1, ..., reward, env) goes into bundle i mod `nodes`; a bundle holds
{CPU: the num_cpus of its services, GPU: the pool's gpus}. Different roles in one bundle share its GPUs: each asks
for its share (1 / the bundle's services), so Ray gives them the same devices, as VeRL colocates roles. Replicas of
one role alone in a bundle whose GPUs hold them all (8 rollout replicas of one GPU on a node of 8) each ask for
their own, so Ray gives each different devices. With rollout.engine sim, the replicas of one bundle run in one
process (rollout_hosts).
A pool Ray cannot reserve (`nodes: 2` on a one-node cluster without an autoscaler) fails the start after
launcher.startup_timeout_s, naming the key.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from rlfabric.core.config import ConfigError, RunConfig
from rlfabric.core.roles import ROLE_TABLE, GpuRule, Kind
from rlfabric.launch.local import MeshStartError, service_names
from rlfabric.weight_sync.devices import DeviceReport

log = logging.getLogger("rlfabric.launch.local")  # the launchers' one logger


def default_num_gpus(config: RunConfig, role: str) -> float:
    """GPUs a role's service uses on a cluster that has GPUs (launcher.ray.<role>.num_gpus: null), by its
    GPU rule (rlfabric.core.roles)."""
    rule, section = ROLE_TABLE[role].gpus, getattr(config, role, None)  # the coordinator has no section, nor GPUs
    if rule is GpuRule.WORLD_SIZE:
        return section.world_size
    if rule is GpuRule.TENSOR_PARALLEL:
        # SGLang runs as its own server; a vLLM replica's TP ranks are its engine's worker processes
        return 0 if section.engine == "sglang" else section.tensor_parallel_size
    if rule is GpuRule.MODEL:
        return 1 if section.model_path and section.model_device.startswith("cuda") else 0
    return 0


def pool_nodes(config: RunConfig) -> dict[str, list[list[tuple[str, str]]]]:
    """Pool -> its nodes (placement group bundles), each the (service name, role) placed there: the pool's
    i-th service in start order on node i mod resource_pools.<pool>.nodes. A ConfigError naming the key when
    a pool spans more nodes than it has services (a node of it would hold nothing)."""
    services: dict[str, list[tuple[str, str]]] = {}
    for name, role in service_names(config):
        if config.pool_of(role):
            services.setdefault(config.pool_of(role), []).append((name, role))
    layout = {}
    for pool, members in services.items():
        count = config.resource_pools[pool].nodes
        if len(members) < count:
            raise ConfigError(f"resource_pools.{pool}.nodes {count}: the pool holds {len(members)} service(s) "
                              f"({', '.join(name for name, _ in members)}) and each node of a pool runs at least one; "
                              f"lower nodes or put more services in it (rollout.replicas, <role>.pool)")
        layout[pool] = [members[node::count] for node in range(count)]
    return layout


def node_of(config: RunConfig, name: str, role: str) -> tuple[str, int, list[tuple[str, str]]]:
    """(pool, bundle index, the services of that bundle) of a pooled service."""
    pool = config.pool_of(role)
    for index, members in enumerate(pool_nodes(config)[pool]):
        if (name, role) in members:
            return pool, index, members
    raise KeyError(name)


def pool_bundles(config: RunConfig) -> dict[str, list[dict[str, float]]]:
    """The placement group of each pool in use: a bundle per node, holding the CPUs its services reserve
    (launcher.ray.<role>.num_cpus) and the pool's GPUs per node."""
    bundles = {}
    for name, nodes in pool_nodes(config).items():
        gpus = config.resource_pools[name].gpus_per_node
        bundles[name] = [{"CPU": float(sum(getattr(config.launcher.ray, role).num_cpus for _, role in members)),
                          **({"GPU": float(gpus)} if gpus else {})} for members in nodes]
    return bundles


def describe_pools(config: RunConfig) -> list[str]:
    """One line per pool: its placement group's bundles and the services in each (`rlfabric up --dry-run`)."""
    lines = []
    bundles = pool_bundles(config)
    for name, nodes in pool_nodes(config).items():
        strategy = _strategy(len(nodes))
        where = "; ".join(f"node {index}: {', '.join(service for service, _ in members)}"
                          for index, members in enumerate(nodes))
        lines.append(f"ray placement group {name}: bundles {bundles[name]} ({strategy}; {where})")
    return lines


def _strategy(nodes: int) -> str:
    """A pool's placement strategy: its bundles on distinct nodes when it has several."""
    return "STRICT_SPREAD" if nodes > 1 else "PACK"


def pool_gpu_share(config: RunConfig, name: str, role: str, num_gpus: float) -> float:
    """What a service of a pool asks Ray for: alone on its node of the pool, its GPUs; shared, its share of one
    GPU (1 / the services on that node), so Ray gives them the same devices. (Ray does not pin CPU cores: a
    pool's `cpus` apply to the local launcher only.) A ConfigError naming the key when the service needs more
    GPUs than one node of the pool has: a service's ranks all run on its node."""
    pool, _, members = node_of(config, name, role)
    per_node = config.resource_pools[pool].gpus_per_node
    if per_node and num_gpus > per_node:
        raise ConfigError(f"resource_pools.{pool}.gpus {per_node} per node: {name} needs {num_gpus:g} GPUs on one "
                          f"node (launcher.ray.{role}.num_gpus, else {role}.world_size): give the pool more GPUs "
                          "per node, not more nodes")
    if len(members) == 1 or side_by_side(config, pool, members, num_gpus):
        return num_gpus
    if num_gpus > 1:
        raise ConfigError(f"{role}.pool {pool}: a service on {num_gpus:g} GPUs cannot share a node of a pool with "
                          "others on Ray (a Ray actor takes at most a fraction of one GPU when it shares): give it "
                          "a pool of its own, or the pool one node per service (resource_pools.<pool>.nodes)")
    return num_gpus / len(members)


def side_by_side(config: RunConfig, pool: str, members: list[tuple[str, str]], num_gpus: float) -> bool:
    """Whether the services of one node of a pool each get GPUs of their own: they are replicas of one role (the
    rollout's), whose GPUs together fit the node's, as 8 replicas of one GPU fill a node of 8. Different roles on
    one node share its GPUs instead: colocation is what a pool of several roles asks for."""
    return len({role for _, role in members}) == 1 and num_gpus * len(members) <= config.resource_pools[pool].gpus_per_node


def rollout_hosts(config: RunConfig, rollouts: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The processes that serve the rollout replicas, each the replicas it serves: one process a replica, but with
    rollout.engine sim the replicas of one node of their pool in one (`rlfabric serve rollout --replicas`: a sim
    replica is an asyncio timer, and hundreds of them fit in a process where hundreds of processes would not
    fit in a machine's memory). Such a process reserves what its replicas would, together."""
    pool = config.rollout.pool
    if config.rollout.engine != "sim" or not pool:
        return [[service] for service in rollouts]
    hosts = []
    for members in pool_nodes(config)[pool]:
        replicas = [service for service in members if service in rollouts]
        if replicas:
            hosts.append(replicas)
    return hosts


def requested_gpus(config: RunConfig, role: str, cluster_has_gpus: bool) -> float:
    """launcher.ray.<role>.num_gpus, null resolved: default_num_gpus on a cluster with GPUs, else 0."""
    num_gpus = getattr(config.launcher.ray, role).num_gpus
    if num_gpus is None:
        pool = config.pool_of(role)
        if pool and not config.resource_pools[pool].gpus_per_node:
            return 0  # a pool without GPUs: its roles run on CPU, as with the local launcher
        return default_num_gpus(config, role) if cluster_has_gpus else 0
    return num_gpus


def reserved_devices(config: RunConfig, cluster_has_gpus: bool) -> tuple[DeviceReport, dict[str, DeviceReport]]:
    """The devices the actor and each rollout replica will hold as Ray places them, as far as the launcher can
    tell: none reserved = CPU; services sharing a pool share its GPU (each reserves a fraction of one, which
    Ray packs onto the same device); a service reserving whole GPUs alone gets its own. SGLang's server picks
    its own GPU: unknown."""
    def report(name: str, role: str) -> DeviceReport:
        if not requested_gpus(config, role, cluster_has_gpus):
            return DeviceReport("cpu")
        if config.pool_of(role):
            pool, node, members = node_of(config, name, role)
            alone = side_by_side(config, pool, members, requested_gpus(config, role, cluster_has_gpus))
            if len(members) > 1 and not alone:
                where = f"node {node} of resource pool {pool}" if config.resource_pools[pool].nodes > 1 else (
                    f"resource pool {pool}")
                return DeviceReport("cuda:0", f"0 of {where}")
        return DeviceReport("cuda:0", f"0 of {name}")

    replicas = [name for name, role in service_names(config) if ROLE_TABLE[role].kind is Kind.ROLLOUT]
    sglang = config.rollout.engine == "sglang"
    return report("actor", "actor"), {name: DeviceReport() if sglang else report(name, "rollout") for name in replicas}



def reserve_pools(groups: dict[str, PlacementGroup], bundles: dict[str, list[dict[str, float]]], namespace: str,
                  timeout_s: float) -> None:
    """One placement group per resource pool (named <namespace>-<pool>), ready before any service is placed. A
    pool that spans more nodes than the cluster has alive is waited for up to timeout_s (an autoscaler may add
    them), then a MeshStartError naming resource_pools.<pool>.nodes. Each group goes into `groups` as soon as it
    is made, so the caller's stop removes every one, also when this fails."""
    alive = sum(1 for node in ray.nodes() if node["Alive"])
    for name, specs in bundles.items():
        strategy = _strategy(len(specs))
        groups[name] = placement_group(specs, strategy=strategy, name=f"{namespace}-{name}")
        if len(specs) > alive:
            log.warning("resource pool spans more nodes than the Ray cluster has", extra={"fields": {
                "key": f"resource_pools.{name}.nodes", "nodes": len(specs), "alive_nodes": alive,
                "waiting_s": timeout_s}})
    deadline = time.monotonic() + timeout_s
    for name, group in groups.items():
        if not group.wait(max(0.0, deadline - time.monotonic())):
            raise MeshStartError(_not_reserved(name, group, timeout_s))
        nodes = placement_group_table(group)["bundles_to_node_id"]
        log.info("resource pool reserved", extra={"fields": {
            "pool": name, "nodes": [nodes[index] for index in sorted(nodes)]}})


def _not_reserved(name: str, group: PlacementGroup, timeout: float) -> str:
    free = ray.available_resources()
    alive = sum(1 for node in ray.nodes() if node["Alive"])
    nodes = len(group.bundle_specs)
    why = ""
    if nodes > 1:
        why = (f"resource_pools.{name}.nodes {nodes} needs {nodes} distinct Ray nodes, each with one bundle's "
               f"resources free, and the cluster has {alive} alive node(s); ")
    return (f"resource pool {name} ({group.bundle_specs}) was not reserved on the Ray cluster within "
            f"{timeout:g} s: {why}free now: CPU {free.get('CPU', 0):g}, GPU {free.get('GPU', 0):g}")
