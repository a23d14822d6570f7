"""The mesh's roles, one row each: the module that serves it, its kind and its GPU rule.

Everything that treats roles differently reads this table: `rlfabric serve` (which servicer to build), the
launchers (what to start, in which order, on which devices: rlfabric.launch) and RunConfig.roles_in_use (the
start order). None of them compares a role's name (tests/test_layering.py checks), so a new role is a new
row here, with its config section and its servicer module.

| role        | servicer                      | kind        | GPUs            |
|-------------|-------------------------------|-------------|-----------------|
| actor       | rlfabric.actor.servicer       | trainer     | world_size      |
| reference   | rlfabric.reference.servicer   | trainer     | world_size      |
| critic      | rlfabric.critic.servicer      | trainer     | world_size      |
| teacher     | rlfabric.reference.teacher    | trainer     | world_size      |
| rollout     | rlfabric.rollout.servicer     | rollout     | tensor_parallel |
| judge       | rlfabric.rollout.judge        | judge       | tensor_parallel |
| reward      | rlfabric.reward.servicer      | service     | model           |
| env         | rlfabric.env.servicer         | environment | none            |
| coordinator | rlfabric.coordinator.servicer | coordinator | none            |

A servicer is named by its module path and imported only when its role is served: core sits below the roles
and imports none of them, and the reward process never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    """What sort of service a role is; the launchers treat the roles of one kind alike."""

    TRAINER = "trainer"
    """A model the trainer package serves: <role>.world_size ranks, one process each (a rank >= 1 answers health
    only); computes with torch."""
    ROLLOUT = "rollout"
    """Generation: <role>.replicas services named ROLE-0, ROLE-1, ...; each calls only the environments its own
    config names, so they start once the environment's address is in it; computes with torch."""
    JUDGE = "judge"
    """The generative judge's pool: <role>.replicas rollout services ROLE-0, ROLE-1, ... serving a model of their
    own (<role>.model_path); started first, their addresses written into the reward's config
    (reward.judge.addresses); never in the weight-sync set; computes with torch."""
    SERVICE = "service"
    """One process, started with the others; once the environment's and the judge pool's addresses are in its
    config when the run has them (the reward calls the judge)."""
    ENVIRONMENT = "environment"
    """The environment the rollout calls: it holds the environment link's token, never the mesh's; started
    first, its address written into the other services' config (cluster.env)."""
    COORDINATOR = "coordinator"
    """Drives the run: started last, with every other service's address (config.resolved.yaml); in no resource
    pool, never left to the user (--external)."""


class GpuRule(Enum):
    """Which GPUs a service of the role takes: of its resource pool's (the local launcher), and how many it
    reserves when launcher.ray.<role>.num_gpus is null (the Ray launcher)."""

    WORLD_SIZE = "world_size"
    """<role>.world_size GPUs: the first of its pool's."""
    TENSOR_PARALLEL = "tensor_parallel"
    """<role>.tensor_parallel_size GPUs per replica: replica i takes slice i (mod the slices) of its pool's; on
    Ray none for an SGLang server, which holds its own."""
    MODEL = "model"
    """Every GPU of its pool; on Ray one when its model (<role>.model_path) runs on cuda (<role>.model_device)."""
    NONE = "none"
    """Every GPU of its pool; on Ray none."""


@dataclass(frozen=True)
class Role:
    """One row of the table."""

    name: str
    servicer: str  # the module whose build_service(config) returns the role's ServiceDefinition
    kind: Kind
    gpus: GpuRule

    @property
    def computes_with_torch(self) -> bool:
        """Its services share the cores with the other torch services (rlfabric.launch.placement)."""
        return self.kind in (Kind.TRAINER, Kind.ROLLOUT, Kind.JUDGE)

    @property
    def replicated(self) -> bool:
        """Its services are <role>.replicas replicas named ROLE-0, ROLE-1, ... (served with their replica number)."""
        return self.kind in (Kind.ROLLOUT, Kind.JUDGE)

    @property
    def has_pool(self) -> bool:
        """Its config section has a `pool` key (resource_pools); the coordinator's has none."""
        return self.kind is not Kind.COORDINATOR


ROLE_TABLE: dict[str, Role] = {role.name: role for role in (
    Role("actor", "rlfabric.actor.servicer", Kind.TRAINER, GpuRule.WORLD_SIZE),
    Role("reference", "rlfabric.reference.servicer", Kind.TRAINER, GpuRule.WORLD_SIZE),
    Role("critic", "rlfabric.critic.servicer", Kind.TRAINER, GpuRule.WORLD_SIZE),
    Role("teacher", "rlfabric.reference.teacher", Kind.TRAINER, GpuRule.WORLD_SIZE),
    Role("rollout", "rlfabric.rollout.servicer", Kind.ROLLOUT, GpuRule.TENSOR_PARALLEL),
    Role("judge", "rlfabric.rollout.judge", Kind.JUDGE, GpuRule.TENSOR_PARALLEL),
    Role("reward", "rlfabric.reward.servicer", Kind.SERVICE, GpuRule.MODEL),
    Role("env", "rlfabric.env.servicer", Kind.ENVIRONMENT, GpuRule.NONE),
    Role("coordinator", "rlfabric.coordinator.servicer", Kind.COORDINATOR, GpuRule.NONE),
)}
ROLES = tuple(ROLE_TABLE)  # every role's name, in start order
TRAINER_ROLES = tuple(name for name, role in ROLE_TABLE.items() if role.kind is Kind.TRAINER)
POOL_ROLES = tuple(name for name, role in ROLE_TABLE.items() if role.has_pool)  # roles whose section has `pool`


def role_of(name: str) -> Role:
    """The row of role `name`; ValueError naming the roles for any other name."""
    try:
        return ROLE_TABLE[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; roles are {', '.join(ROLES)}") from None
