"""The order in which a launcher starts a mesh's services, and what the later ones' config says of the earlier
ones' addresses (the local and the Ray launcher share it): the env service and the judge pool first, then the
services that call them."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from rlfabric.core.config import RunConfig, dump_config
from rlfabric.core.roles import ROLE_TABLE, Kind


class LaunchedService(Protocol):
    """What the launchers know of a started service (ServiceProcess, RayService)."""

    name: str
    role: str

    @property
    def grpc_address(self) -> str: ...

    def exit_report(self) -> str | None: ...

    def log_tail(self, lines: int = 20) -> str: ...


def spawn_order(
    services: Sequence[tuple[str, str]],
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """(the services whose addresses the others' config names: the env service and the judge replicas; the ones
    started at once beside them; the ones started once those addresses are in the workers' config: the rollout
    replicas, which call only environment addresses their own config names, and the reward service, which calls
    the judge pool its config names)."""

    def kind(service: tuple[str, str]) -> Kind:
        return ROLE_TABLE[service[1]].kind

    first = [s for s in services if kind(s) in (Kind.ENVIRONMENT, Kind.JUDGE)]
    late = [s for s in services if kind(s) is Kind.ROLLOUT or (first and kind(s) is Kind.SERVICE)]
    return first, [s for s in services if s not in first and s not in late], late


def name_addresses(config: RunConfig, addresses: Mapping[str, Sequence[str]]) -> None:
    """The roles' addresses (role -> addresses) as cluster.<role>, and a judge pool's also as reward.judge.addresses
    (the reward service calls those)."""
    for role, listed in addresses.items():
        setattr(config.cluster, role, list(listed))
        if ROLE_TABLE[role].kind is Kind.JUDGE:
            config.reward.judge.addresses = list(listed)


def write_worker_config(config: RunConfig, path: Path, addresses: Mapping[str, Sequence[str]]) -> None:
    """The workers' config (RUN_DIR/config.yaml) again, with the first-started services' addresses named
    (name_addresses); replaced atomically, so a service starting now reads either version whole."""
    name_addresses(config, addresses)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    dump_config(config, tmp)
    tmp.replace(path)


def addresses_of(services: Sequence[LaunchedService]) -> dict[str, list[str]]:
    """Role -> the gRPC addresses of its services, in order."""
    addresses: dict[str, list[str]] = {}
    for service in services:
        addresses.setdefault(service.role, []).append(service.grpc_address)
    return addresses
