"""Where each service of a run goes on this machine: its resource pool's GPUs and CPU cores.

    placements = plan_placement(config, gpu_count=visible_gpu_count())
    placements["rollout-0"].env()        # {"CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "1"}
    print(describe_placement(config, placements))   # what `rlfabric up --dry-run` prints

A pool's GPUs: its `devices`, or for `gpus: N` the next N indices no pool names. Indices count the GPUs the
launcher itself sees (so under CUDA_VISIBLE_DEVICES=2,3, device 0 is GPU 2). Inside a pool the roles share
the devices, as in VeRL's hybrid engine: a trainer with world_size W takes the pool's first W GPUs, rollout
replica i takes GPU i mod the pool's size (with rollout.tensor_parallel_size T, the pool's GPUs split into slices
of T and replica i takes slice i mod their count), the reward service sees them all. A pool without GPUs hides every
GPU (its roles run on CPU). A pool's `cpus` pin its services (and the ranks and engine workers they start,
which inherit the affinity) to those cores, so separate pools are separate on a CPU-only machine too.
Services of no pool (and the coordinator) keep the launcher's devices and cores, and each gets OMP_NUM_THREADS =
cores // the torch services (actor, reference, critic, rollout replicas) that compute at the same time as it, at
least 1: four services each spinning one OpenMP thread per core on a small machine made the actor's update several
times slower. In async mode that is all of them; in sync mode the replicas generate, then the trainers train, so
each phase's services share the cores and the other phase's do not count (computes_with). Every service's OpenMP
threads sleep as soon as they are idle (OMP_WAIT_POLICY=PASSIVE, unless the launcher's environment sets it), so a
service waiting for its turn leaves the cores to the one computing (launcher.threads_per_service sets the count
instead). The Ray launcher places pools as placement groups instead (rlfabric.launch.ray_placement); the
in-process mesh runs every role in one process, where pools do not apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlfabric.core.config import ConfigError, RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.host import index_ranges
from rlfabric.core.roles import ROLE_TABLE, GpuRule, Kind
from rlfabric.weight_sync.devices import DeviceReport, TransportChoice, choose_transport


@dataclass(frozen=True)
class Placement:
    """The devices one service may use."""

    service: str  # "actor", "rollout-1", ...
    role: str
    pool: str  # "" = no pool: the launcher's own devices and cores
    gpus: tuple[int, ...] | None  # GPU indices as the launcher sees them; None = unrestricted, () = none
    cpus: tuple[int, ...] | None  # CPU cores; None = any
    threads: int | None = None  # OMP_NUM_THREADS; None = the pool's core count (or torch's own default)

    def env(self) -> dict[str, str]:
        """Environment variables that confine the service to its GPUs (and size its thread pools to its cores)."""
        # Idle OpenMP threads sleep at once instead of spinning (unless the launcher's environment says otherwise):
        # a service that waits for its turn, or between small ops, leaves the shared cores to the one computing.
        env = {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(_launcher_gpu_ids()[i] for i in self.gpus)
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        elif self.cpus is not None:
            env["OMP_NUM_THREADS"] = str(len(self.cpus))
        return env

    def pin(self) -> None:
        """Pins the calling process to the pool's cores (in a child before exec: preexec_fn)."""
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)


def _launcher_gpu_ids() -> list[str]:
    """The launcher's GPUs as CUDA_VISIBLE_DEVICES entries: its own list, or 0..63 when it sees every GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(64)]
    return [entry.strip() for entry in visible.split(",") if entry.strip()]


def threads_per_service(config: RunConfig, services: list[tuple[str, str]], role: str) -> int:
    """OMP_NUM_THREADS of a service of `role`: launcher.threads_per_service, or when that is 0 the cores it runs
    on (its pool's cpus, else the launcher's) shared evenly by the torch services on them that compute at the
    same time as it (computes_with), at least 1."""
    if config.launcher.threads_per_service:
        return config.launcher.threads_per_service
    cores_of = _cores_pool(config, role)
    cores = len(config.resource_pools[cores_of].cpus) if cores_of else len(os.sched_getaffinity(0))
    sharing = sum(1 for _, other in services
                  if ROLE_TABLE[other].computes_with_torch and _cores_pool(config, other) == cores_of and computes_with(config, role, other))
    return max(1, cores // max(1, sharing))


def computes_with(config: RunConfig, role: str, other: str) -> bool:
    """Whether a service of `role` computes while one of `other` does. In async mode every service overlaps
    (generation goes on while the trainers train). In sync mode (colocated too) the services take turns: the
    rollout replicas generate together, then the trainers (actor, reference, critic) compute together, so a
    trainer and a replica never need the same cores at once. A service of no torch role (reward, env) is
    counted as overlapping them all."""
    if config.trainer.mode == "async" or not ROLE_TABLE[role].computes_with_torch:
        return True
    return (ROLE_TABLE[role].kind is Kind.ROLLOUT) == (ROLE_TABLE[other].kind is Kind.ROLLOUT)


def _cores_pool(config: RunConfig, role: str) -> str:
    """The pool whose cpus the role is pinned to; "" = the launcher's cores."""
    pool = config.pool_of(role)
    return pool if pool and config.resource_pools[pool].cpus else ""


def visible_gpu_count() -> int:
    """GPUs this process sees (0 without CUDA); counted without initialising CUDA here."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def pool_gpus(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """Each pool's GPU indices on this machine: `devices` as given, then `gpus: N` from the lowest free index."""
    taken = {index for pool in config.resource_pools.values() for index in pool.devices}
    gpus: dict[str, tuple[int, ...]] = {}
    next_free = 0
    for name, pool in config.resource_pools.items():
        if pool.devices:
            gpus[name] = tuple(pool.devices)
            continue
        chosen = []
        while len(chosen) < pool.gpus:
            if next_free not in taken:
                chosen.append(next_free)
                taken.add(next_free)
            next_free += 1
        gpus[name] = tuple(chosen)
    return gpus


def plan_placement(config: RunConfig, services: list[tuple[str, str]],
                   gpu_count: int | None = None) -> dict[str, Placement]:
    """The placement of every (service name, role) in `services` (launch.local.service_names). With
    gpu_count (the GPUs this machine has), a pool that asks for more, a multi-node pool or a core the
    launcher may not use is a ConfigError naming the pool."""
    gpus_of_pool = pool_gpus(config)
    if gpu_count is not None:
        check_fits_this_machine(config, gpus_of_pool, gpu_count)
    placements = {}
    for name, role in services:
        pool_name = config.pool_of(role)
        threads = threads_per_service(config, services, role)
        if not pool_name:
            placements[name] = Placement(name, role, "", None, None, threads)
            continue
        pool_gpus_ = gpus_of_pool[pool_name]
        cpus = tuple(config.resource_pools[pool_name].cpus) or None
        placements[name] = Placement(name, role, pool_name, _role_gpus(config, name, role, pool_gpus_), cpus, threads)
    return placements


def _role_gpus(config: RunConfig, name: str, role: str, pool: tuple[int, ...]) -> tuple[int, ...]:
    """The GPUs of its pool that service `name` takes, by its role's GPU rule (rlfabric.core.roles)."""
    if not pool:
        return ()
    rule = ROLE_TABLE[role].gpus
    if rule is GpuRule.WORLD_SIZE:
        return pool[: getattr(config, role).world_size]
    if rule is GpuRule.TENSOR_PARALLEL:  # the pool's devices in slices of tensor_parallel_size (checked to divide them)
        tp = getattr(config, role).tensor_parallel_size
        start = int(name.rpartition("-")[2]) % max(1, len(pool) // tp) * tp
        return pool[start : start + tp]
    return pool


def check_fits_this_machine(config: RunConfig, gpus_of_pool: dict[str, tuple[int, ...]], gpu_count: int) -> None:
    """The pools ask for what this one machine has: its GPUs, its cores, one node."""
    usable_cores = os.sched_getaffinity(0)
    for name, pool in config.resource_pools.items():
        if pool.nodes > 1:
            raise ConfigError(f"resource_pools.{name}.nodes {pool.nodes}: the local launcher runs on one node "
                              "(use --launcher ray or the Helm chart)")
        beyond = [index for index in gpus_of_pool[name] if index >= gpu_count]
        if beyond:
            raise ConfigError(f"resource_pools.{name} needs GPU(s) {list(gpus_of_pool[name])}; this machine "
                              f"has {gpu_count} (indices 0..{gpu_count - 1})" if gpu_count else
                              f"resource_pools.{name} needs {len(gpus_of_pool[name])} GPU(s); this machine has none")
        missing = sorted(set(pool.cpus) - usable_cores)
        if missing:
            raise ConfigError(f"resource_pools.{name}.cpus {missing}: not cores this launcher may use "
                              f"({index_ranges(sorted(usable_cores))})")


def describe_placement(config: RunConfig, placements: dict[str, Placement]) -> str:
    """A table of the pools and of where each service runs (`rlfabric up --dry-run`)."""
    lines = []
    gpus_of_pool = pool_gpus(config)
    for name, pool in config.resource_pools.items():
        roles = sorted({p.role for p in placements.values() if p.pool == name})
        lines.append(f"pool {name}: GPUs {index_ranges(gpus_of_pool[name]) or 'none'}, CPUs {index_ranges(pool.cpus) or 'any'}"
                     f", nodes {pool.nodes}; roles: {', '.join(roles) or 'none'}")
    width = max((len(name) for name in placements), default=0)
    pool_width = max((len(p.pool) for p in placements.values()), default=1) or 1
    for name, placement in placements.items():
        gpus = "all" if placement.gpus is None else (index_ranges(placement.gpus) or "none (CPU)")
        cpus = "any" if placement.cpus is None else index_ranges(placement.cpus)
        threads = "" if placement.threads is None else f"  threads {placement.threads}"  # OMP_NUM_THREADS
        lines.append(f"{name:<{width}}  pool {placement.pool or '-':<{pool_width}}  GPUs {gpus:<10}  CPUs {cpus:<6}{threads}")
    tp_line = tensor_parallel_layout(config, placements)
    return "\n".join(lines + ([tp_line] if tp_line else []))


def tensor_parallel_layout(config: RunConfig, placements: dict[str, Placement]) -> str:
    """How the rollout replicas split their devices with rollout.tensor_parallel_size ("" without it)."""
    tp = config.rollout.tensor_parallel_size
    replicas = [p for p in placements.values() if ROLE_TABLE[p.role].kind is Kind.ROLLOUT]
    if tp == 1 or not replicas:
        return ""
    pool = config.rollout.pool
    gpus = pool_gpus(config).get(pool, ()) if pool else ()
    if gpus:
        holds = len(gpus) // tp
        shared = f"; {len(replicas) - holds} more share them" if len(replicas) > holds else ""
        return (f"rollout: tensor_parallel_size {tp}: {len(replicas)} replica(s) of {tp} GPUs each; pool {pool}'s "
                f"{len(gpus)} GPUs hold {holds}{shared}. Weight sync reaches each replica's TP rank 0, which "
                "forwards to its TP peers")
    from rlfabric.rollout.tensor_parallel import cpu_binding, numa_node_count

    cpus = replicas[0].cpus or tuple(sorted(os.sched_getaffinity(0)))
    binding = cpu_binding(list(cpus), tp, numa_node_count()) or "one NUMA node each (vLLM's auto binding)"
    return (f"rollout: tensor_parallel_size {tp}: each replica runs {tp} vLLM workers (on GPUs 0-{tp - 1} of "
            f"those it sees; on CPU, cores {binding}). Weight sync reaches each replica's TP rank 0, which forwards "
            "to its TP peers")


def placed_devices(config: RunConfig, placements: dict[str, Placement], gpu_count: int,
                   external=()) -> tuple[DeviceReport, dict[str, DeviceReport]]:
    """The devices the actor and each rollout replica will report as placed here, each GPU named by its
    launcher's CUDA_VISIBLE_DEVICES entry (a service outside any pool sees every GPU and computes on the first).
    Unknown (empty) for a role started elsewhere (`external`) and for SGLang, whose server picks its own GPU."""
    gpu_ids = _launcher_gpu_ids()

    def report(name: str, role: str) -> DeviceReport:
        if role in external:
            return DeviceReport()
        gpus = placements[name].gpus
        gpus = ((0,) if gpu_count else ()) if gpus is None else gpus
        return DeviceReport("cuda:0", gpu_ids[gpus[0]]) if gpus else DeviceReport("cpu")

    replicas = [name for name, placement in placements.items() if ROLE_TABLE[placement.role].kind is Kind.ROLLOUT]
    sglang = config.rollout.engine == "sglang"
    return report("actor", "actor"), {name: DeviceReport() if sglang else report(name, "rollout") for name in replicas}


def predicted_transport(config: RunConfig, devices: tuple[DeviceReport, dict[str, DeviceReport]]) -> TransportChoice:
    """The weight-sync transport the coordinator will choose on the devices a launcher gives the actor and the
    rollout replicas (placed_devices here, rlfabric.launch.ray_placement.reserved_devices on Ray), as far as they
    tell the GPUs apart; a ConfigError naming weight_sync.transport for nccl forced where it cannot run."""
    actor, replicas = devices
    try:
        return choose_transport(config.weight_sync.transport, actor, replicas)
    except FailedPrecondition as error:
        raise ConfigError(str(error)) from None
