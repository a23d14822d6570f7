"""Builds and runs one role's service: `rlfabric serve ROLE --config C`.

Each role folder's servicer.py has `build_service(config) -> ServiceDefinition` (its servicer and engine);
this module maps role names to those functions explicitly and imports them lazily, so the reward
process never imports torch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlfabric.core import tracing
from rlfabric.core.config import ROLES, RunConfig
from rlfabric.core.server import ServerOptions, ServiceDefinition, serve


def build_service(role: str, config: RunConfig) -> ServiceDefinition:
    """The ServiceDefinition of `role` for this config: each role folder's servicer.build_service."""
    if role == "coordinator":
        from rlfabric.coordinator.servicer import build_service as build_coordinator_service

        return build_coordinator_service(config)
    if role == "actor":
        from rlfabric.actor.servicer import build_service as build_actor_service

        return build_actor_service(config)
    if role == "reference":
        from rlfabric.reference.servicer import build_service as build_reference_service

        return build_reference_service(config)
    if role == "critic":
        from rlfabric.critic.servicer import build_service as build_critic_service

        return build_critic_service(config)
    if role == "reward":
        from rlfabric.reward.servicer import build_service as build_reward_service

        return build_reward_service(config)
    if role == "env":
        from rlfabric.env.servicer import build_service as build_env_service

        return build_env_service(config)
    if role == "rollout":
        from rlfabric.rollout.servicer import build_service as build_rollout_service

        return build_rollout_service(config)
    raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")


def run_service(role: str, config: RunConfig, options: ServerOptions, port_file: Path | None = None) -> None:
    """Serves `role` until SIGTERM/SIGINT; a rank >= 1 of a role launched one process per rank (RANK etc.
    set, e.g. a StatefulSet pod) runs that rank instead, with only health on its port (the pod's probes)."""
    if role in ("actor", "reference", "critic"):
        from rlfabric.trainer.dist import external_launch, serve_rank

        launch = external_launch()
        if launch is not None and launch[0] > 0:
            port = options.health_port if options.health_port is not None else options.port
            serve_rank(role, config, f"{options.host}:{port}", *launch)
            return
    tracing.setup(config.tracing, role)  # first: the channels a service opens get its interceptor
    try:
        service = build_service(role, config)
        asyncio.run(serve(service, options, port_file=port_file))
    finally:
        tracing.shutdown()  # exports the spans still queued
