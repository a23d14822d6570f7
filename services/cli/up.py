"""`rlfabric up`: a mesh until Ctrl-C (`--dry-run`: where each service would run; `--external`: roles you
serve yourself); the mesh start `rlfabric train` shares."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from rlfabric.cli.args import _split_config_and_overrides
from rlfabric.core.config import ConfigError, load_run_config
from rlfabric.core.logs import setup_logging


def _start_mesh(args):
    """The mesh `rlfabric up` asks for (not started yet: `with mesh:` starts it)."""
    from rlfabric.launch.local import default_run_dir

    config_path, overrides = _split_config_and_overrides(args)
    config = load_run_config(config_path, overrides)
    run_dir = args.run_dir or default_run_dir(config)
    setup_logging("launcher", run_dir.name, config.server.log_level)
    return build_mesh(config, run_dir, args.launcher, args.address, _external_roles(args.external))

def build_mesh(config, run_dir: Path, launcher: str = "local", ray_address: str | None = None,
               external: dict[str, list[str]] | None = None):
    """The mesh of `launcher` ("local": a process per service; "ray": a Ray actor per service) for `config`
    in run_dir, not started yet; `external`: roles someone else serves (local only)."""
    from rlfabric.launch.local import LocalMesh
    from rlfabric.launch.scrape_targets import TARGETS_FILE

    external = external or {}
    outputs = f"logs in {run_dir}/logs, Prometheus targets in {run_dir / TARGETS_FILE}"
    if launcher == "ray":
        if external:
            raise ConfigError("--external is for the local launcher")
        try:
            from rlfabric.launch.ray import RayMesh
        except ImportError as error:
            raise ConfigError(f"--launcher ray needs Ray ({error}); pip install 'rlfabric[ray]'") from None
        print(f"rlfabric: starting the mesh on Ray in {run_dir} ({outputs})", flush=True)
        return RayMesh(config, run_dir, address=ray_address)
    if ray_address:
        raise ConfigError("--address is for --launcher ray")
    print(f"rlfabric: starting the local mesh in {run_dir} ({outputs})", flush=True)
    for role, addresses in external.items():
        port = addresses[0].rpartition(":")[2]
        print(f"rlfabric: not starting {role}: serve it at {', '.join(addresses)} yourself, e.g. "
              f"rlfabric serve {role} --config {run_dir}/config.yaml --port {port} --metrics-port 0", flush=True)
    return LocalMesh(config, run_dir, external=external)

def _external_roles(items: list[str]) -> dict[str, list[str]]:
    """`--external ROLE=HOST:PORT` arguments as {role: [addresses]}."""
    external: dict[str, list[str]] = {}
    for item in items:
        role, sep, address = item.partition("=")
        if not sep or not address:
            raise ConfigError(f"--external {item}: give ROLE=HOST:PORT")
        external.setdefault(role, []).append(address)
    return external

def _raise_on_sigterm() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)

def cmd_up(args) -> int:
    if args.dry_run:
        return _print_placement(args)
    _raise_on_sigterm()
    mesh = _start_mesh(args)
    with mesh:
        print(json.dumps(mesh.endpoints, indent=2), flush=True)
        print(f"rlfabric: mesh ready; endpoints in {mesh.run_dir / 'endpoints.json'}. Ctrl-C to stop.", flush=True)
        try:
            while not (failed := mesh.failed()):
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("rlfabric: stopping the mesh", flush=True)
            return 0
        dead = ", ".join(f"{p.name} {p.exit_report()}" for p in failed)  # before stop() ends the others
    print(f"rlfabric: service(s) exited: {dead}; mesh stopped", file=sys.stderr)
    return 1

def _print_placement(args) -> int:
    """`rlfabric up --dry-run` (and `train --dry-run`): the services the config starts and the devices each
    gets, then every check of `rlfabric check`; nothing starts."""
    from rlfabric.cli.check import report_checks
    from rlfabric.launch.local import plan_local, service_names
    from rlfabric.launch.placement import describe_placement, plan_placement
    from rlfabric.rollout.tensor_parallel import check_model_splits

    config_path, overrides = _split_config_and_overrides(args)
    config = load_run_config(config_path, overrides)
    services = service_names(config) + [("coordinator", "coordinator")]
    print(describe_placement(config, plan_placement(config, services)))
    try:
        check_model_splits(config)  # rollout.tensor_parallel_size against the model's heads
    except ConfigError as error:
        print(f"rlfabric: the rollout replicas cannot start: {error}")
        return 1
    if args.launcher == "ray":  # one placement group per pool; Ray picks the devices within it
        try:
            from rlfabric.launch.placement import predicted_transport
            from rlfabric.launch.ray_placement import describe_pools, reserved_devices
        except ImportError as error:
            raise ConfigError(f"--launcher ray needs Ray ({error}); pip install 'rlfabric[ray]'") from None
        print("\n".join(describe_pools(config)))
        try:
            choice = predicted_transport(config, reserved_devices(config, cluster_has_gpus=True))
        except ConfigError as error:
            print(f"rlfabric: a Ray cluster with GPUs cannot run it: {error}")
            return 1
        print(f"weight sync on a cluster with GPUs: {choice.transport or 'as the actor chooses'} ({choice.reason})")
    else:
        try:
            _, choice = plan_local(config)
        except ConfigError as error:
            print(f"rlfabric: this machine cannot run it with the local launcher: {error}")
            return 1
        print(f"weight sync: {choice.transport or 'as the actor chooses'} ({choice.reason})")
    return report_checks(config, resources=False, out=args.out)  # the placement above was the resources' check
