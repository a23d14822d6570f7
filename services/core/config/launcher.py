"""launcher and resource_pools: where services run (processes, Ray, GPUs and cores)."""

from __future__ import annotations

from pydantic import (
    Field,
    model_validator,
)

from rlfabric.core.config.base import Section


class RayResources(Section):
    """What one service of a role reserves on the Ray cluster (`--launcher ray`)."""

    num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves for the service (Ray also sets its OMP_NUM_THREADS to this, at least 1)."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs Ray reserves and makes visible; null = auto: 0 on a cluster without GPUs, else world_size (actor, reference, critic, teacher), 1 (rollout or judge replica; reward with a cuda model), 0 (coordinator)."""


class RayLauncherConfig(Section):
    """`rlfabric up --launcher ray`: every service runs under a Ray actor that holds its resources."""

    namespace: str = ""
    """Ray namespace of the run's actors; empty = rlfabric-<run dir name>."""
    actor: RayResources = RayResources()
    reference: RayResources = RayResources()
    critic: RayResources = RayResources()
    teacher: RayResources = RayResources()
    rollout: RayResources = RayResources()
    """Per replica."""
    judge: RayResources = RayResources()
    """Per judge replica."""
    reward: RayResources = RayResources()
    env: RayResources = RayResources()
    coordinator: RayResources = RayResources()


class LauncherConfig(Section):
    """How `rlfabric up`/`train` start the mesh: timeouts, threads and Ray resources."""

    startup_timeout_s: float = Field(300.0, gt=0)
    """How long `rlfabric up` waits for every service to report readiness (model loads included)."""
    stop_timeout_s: float = Field(40.0, gt=0)
    """After SIGTERM, how long a service may drain before the launcher kills it."""
    threads_per_service: int = Field(0, ge=0)
    """OMP_NUM_THREADS (torch's CPU threads) of each service the local launcher starts; 0 = its cores (a pool's
    cpus, else the machine's) divided by the torch services sharing them, at least 1, so they do not oversubscribe."""
    ray: RayLauncherConfig = RayLauncherConfig()
    """Resources and namespace of the Ray launcher."""


class ResourcePoolConfig(Section):
    """A set of devices some roles share (VeRL's resource pool). Roles in one pool are colocated on its devices
    (with trainer.colocated the rollout sleeps while the actor trains); roles in different pools never meet."""

    gpus: int = Field(0, ge=0)
    """GPUs per node; the local launcher gives the pool the next GPUs no pool's `devices` names."""
    devices: list[int] = []
    """Exactly these GPU indices (CUDA device ids) instead of `gpus`; the local launcher sets CUDA_VISIBLE_DEVICES
    of the pool's services from them."""
    cpus: list[int] = []
    """CPU cores the pool's services are pinned to (CPU affinity, inherited by their ranks and engine workers);
    empty = any core."""
    nodes: int = Field(1, ge=1)
    """Nodes the pool spans, at most its services (pods). Ray: a placement group of one bundle per node
    (STRICT_SPREAD), the pool's i-th service on node i mod nodes; Helm: the pool's pods spread over distinct
    nodes, at least this many (topologySpreadConstraints); the local launcher runs one node."""

    @model_validator(mode="after")
    def _gpus_or_devices(self) -> ResourcePoolConfig:
        if self.devices and self.gpus and self.gpus != len(self.devices):
            raise ValueError(f"gpus {self.gpus} disagrees with devices {self.devices}: give one of them")
        if len(set(self.devices)) != len(self.devices) or len(set(self.cpus)) != len(self.cpus):
            raise ValueError("devices and cpus must not repeat an index")
        if any(index < 0 for index in (*self.devices, *self.cpus)):
            raise ValueError("device and cpu indices are >= 0")
        return self

    @property
    def gpus_per_node(self) -> int:
        return len(self.devices) or self.gpus

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes
