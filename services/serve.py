"""Builds and runs one role's service: `rlfabric serve ROLE --config C`.

Each role folder's servicer.py has `build_service(config) -> ServiceDefinition` (its servicer and engine);
the role table (rlfabric.core.roles) names that module for every role, and it is imported only when its
role is served, so the reward process never imports torch.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
from pathlib import Path

from rlfabric.core import tracing
from rlfabric.core.config import RunConfig
from rlfabric.core.roles import Kind, role_of
from rlfabric.core.server import ServerOptions, ServiceDefinition, serve_all


def build_service(role: str, config: RunConfig, replica: int = 0) -> ServiceDefinition:
    """The ServiceDefinition of `role` for this config: its servicer module's build_service; a rollout's (or a
    judge's) as
    replica number `replica` of the run."""
    module = importlib.import_module(role_of(role).servicer)
    if role_of(role).replicated:
        return module.build_service(config, replica=replica)
    return module.build_service(config)


def run_service(role: str, config: RunConfig, options: ServerOptions, port_file: str | Path | None = None,
                replicas: range = range(1)) -> None:
    """Serves `role` until SIGTERM/SIGINT; a rank >= 1 of a role launched one process per rank (RANK etc.
    set, e.g. a StatefulSet pod) runs that rank instead, with only health on its port (the pod's probes).
    A rollout serves each of `replicas` (replica numbers) on ports of its own; port_file then has {replica} in
    its path."""
    if role_of(role).kind is Kind.TRAINER:
        from rlfabric.trainer.dist import external_launch, serve_rank

        launch = external_launch()
        if launch is not None and launch[0] > 0:
            port = options.health_port if options.health_port is not None else options.port
            serve_rank(role, config, f"{options.host}:{port}", *launch)
            return
    tracing.setup(config.tracing, role)  # first: the channels a service opens get its interceptor
    try:
        services = [build_service(role, config, replica=replica) for replica in replicas]
        # What start-up made (torch's and the protos' modules: ~200k objects) leaves the cyclic GC's sight: a
        # full collection walks every tracked object, and the objects a step makes per sample trigger several.
        gc.freeze()
        port_files = [str(port_file).replace("{replica}", str(replica)) if port_file else None for replica in replicas]
        asyncio.run(serve_all(services, options, port_files))
    finally:
        tracing.shutdown()  # exports the spans still queued
