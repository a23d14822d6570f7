"""Builds and runs one role's service: `rlfabric serve ROLE --config C`.

Each role folder's servicer.py has `build_service(config) -> ServiceDefinition` (its servicer and engine);
the role table (rlfabric.core.roles) names that module for every role, and it is imported only when its
role is served, so the reward process never imports torch.
"""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path

from rlfabric.core import tracing
from rlfabric.core.config import RunConfig
from rlfabric.core.roles import Kind, role_of
from rlfabric.core.server import ServerOptions, ServiceDefinition, serve


def build_service(role: str, config: RunConfig) -> ServiceDefinition:
    """The ServiceDefinition of `role` for this config: its servicer module's build_service."""
    return importlib.import_module(role_of(role).servicer).build_service(config)


def run_service(role: str, config: RunConfig, options: ServerOptions, port_file: Path | None = None) -> None:
    """Serves `role` until SIGTERM/SIGINT; a rank >= 1 of a role launched one process per rank (RANK etc.
    set, e.g. a StatefulSet pod) runs that rank instead, with only health on its port (the pod's probes)."""
    if role_of(role).kind is Kind.TRAINER:
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
