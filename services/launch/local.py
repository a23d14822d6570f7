"""The local mesh: every role as its own process on loopback (`rlfabric up` / `rlfabric train`).

    with LocalMesh(config, run_dir) as mesh:    # starts, waits for readiness, writes endpoints.json
        mesh.endpoints["rollout"][0]["grpc"]    # "127.0.0.1:43121"
        mesh.restart("rollout-1")               # after it died: again, on the same gRPC port

    LocalMesh(config, run_dir, external={"actor": ["127.0.0.1:50070"]})   # every role but the actor, which
                                                # you serve yourself (e.g. under a debugger) at that address

Services bind port 0 and report their ports through RUN_DIR/ports/<name>.json (no port races).
Logs go to RUN_DIR/logs/<name>.log. A role in a resource pool sees only the pool's GPUs and runs on its
cores (rlfabric.launch.placement); every service gets an OMP_NUM_THREADS that keeps the services together
within the machine's cores (launcher.threads_per_service). Every RPC needs the mesh's token (RUN_DIR/auth_token, 0600)
unless server.auth_token_file names another; the environment link has a token of its own (RUN_DIR/env_token). Children get SIGTERM if the launcher dies (PR_SET_PDEATHSIG),
and stop() terminates, then kills, every child: no orphans. The env service and the judge pool (judge.model_path)
start first: the rollout replicas start once the env's address is in RUN_DIR/config.yaml (cluster.env), as they
call only an environment their own config names, and the reward service once the judge replicas' are
(reward.judge.addresses).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rlfabric.core.client import ChannelOptions, wait_until_serving
from rlfabric.core.config import ConfigError, RunConfig, dump_config
from rlfabric.core.roles import ROLE_TABLE, Kind
from rlfabric.core.start_phases import StartPhases
from rlfabric.core.storage import create_private_file
from rlfabric.launch.placement import (
    Placement,
    placed_devices,
    plan_placement,
    predicted_transport,
    threads_per_service,
    visible_gpu_count,
)
from rlfabric.launch.scrape_targets import remove_shared_targets, write_scrape_targets
from rlfabric.launch.start_order import (
    LaunchedService,
    addresses_of,
    name_addresses,
    spawn_order,
    write_worker_config,
)
from rlfabric.quickstart import cached
from rlfabric.weight_sync.devices import TransportChoice

log = logging.getLogger("rlfabric.launch.local")

_PR_SET_PDEATHSIG = 1
REGISTRY_PREFIX = "pypi:"  # model.path "pypi:smollm2": a model converted from a PyPI wheel (rlfabric.trainer.pretrained)


def default_run_dir(config: RunConfig) -> Path:
    """runs/<name>-<timestamp>"""
    return Path("runs") / f"{config.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the thread that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ServiceProcess:
    """One launched service process."""

    name: str  # "actor", "rollout-1", ...
    role: str
    process: subprocess.Popen
    log_path: Path
    port_file: Path
    ports: dict | None = None
    host: str = "127.0.0.1"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def exit_report(self) -> str | None:
        """Why the service is gone ("exited with code 1 (log PATH)"), or None while it runs."""
        if self.process.poll() is None:
            return None
        return f"exited with code {self.process.returncode} (log {self.log_path})"


class MeshStartError(RuntimeError):
    """A service of the mesh failed to start or to become ready."""


# -- shared by LocalMesh and RayMesh (rlfabric.launch.ray) ---------------------------------------


def log_tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def worker_roles(config: RunConfig) -> list[str]:
    """The roles the config's runs use (RunConfig.roles_in_use) but the coordinator, which starts after them."""
    return [role for role in config.roles_in_use() if ROLE_TABLE[role].kind is not Kind.COORDINATOR]


def service_names(config: RunConfig) -> list[tuple[str, str]]:
    """(service name, role) of every service the config's runs use, except the coordinator, in start
    order: a critic only for GAE, a reference only when a KL term reads it (RunConfig.roles_in_use), and
    each rollout (or judge) replica ROLE-i."""
    names = []
    for role in worker_roles(config):
        if ROLE_TABLE[role].replicated:
            names += [(f"{role}-{i}", role) for i in range(getattr(config, role).replicas)]
        else:
            names.append((role, role))
    return names


def prepare_run_dir(config: RunConfig, run_dir: Path, phases: StartPhases | None = None) -> Path:
    """Creates RUN_DIR/logs and the mesh's token, sets the storage root to the runs folder, builds the tiny model when model.path is empty (or the cached registry model
    for "pypi:NAME"), points trainer.run_dir at
    RUN_DIR, writes RUN_DIR/config.yaml (what every service but the coordinator reads), returns its path.
    The model's build and check are phases of `phases` (the mesh's start)."""
    phases = phases or StartPhases("mesh", log)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not config.server.auth_token_file:
        config.server.auth_token_file = str(write_mesh_token(run_dir).resolve())
    multi_turn = config.env.enable or config.rollout.multi_turn.enable
    if multi_turn and not config.env.auth_token_file:  # the environment's own: it never gets the mesh's
        config.env.auth_token_file = str(write_mesh_token(run_dir, "env_token").resolve())
    if not config.trainer.run_dir:
        config.trainer.run_dir = str(run_dir.resolve())
    if not config.storage.root:
        config.storage.root = str(run_dir.resolve().parent)  # the runs folder: RPC paths stay inside it
    if not config.model.path:
        with phases.phase("model_build"):
            config.model.path = str(build_tiny_model(run_dir))
    elif config.model.path.startswith(REGISTRY_PREFIX):
        with phases.phase("model_cache"):
            config.model.path = registry_model(config.model.path)
    if config.judge.model_path.startswith(REGISTRY_PREFIX):
        with phases.phase("judge_model_cache"):
            config.judge.model_path = registry_model(config.judge.model_path)
    with phases.phase("model_check"):
        check_model(config)
    worker_config = run_dir / "config.yaml"
    dump_config(config, worker_config)
    return worker_config


def registry_model(path: str) -> str:
    """The directory of model "pypi:NAME", converted from its wheel once per machine."""
    from rlfabric.trainer.pretrained import cached_model

    return str(cached_model(path.removeprefix(REGISTRY_PREFIX)))


def write_mesh_token(run_dir: Path, name: str = "auth_token") -> Path:
    """RUN_DIR/auth_token: a new random bearer token, readable by this user only (0600), that every
    service of the mesh requires and every client of it (the CLI, `rlfabric status`) sends; with `name`
    env_token, the environment link's (env.auth_token_file)."""
    path = run_dir / name
    tmp = run_dir / f".{name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    create_private_file(tmp, secrets.token_urlsafe(32)).replace(path)
    return path


def check_model(config: RunConfig) -> None:
    """A model directory the services cannot use is a ConfigError naming it, before any service starts."""
    import torch

    from rlfabric.core.lora import check_lora_fits
    from rlfabric.core.moe import check_moe_settings
    from rlfabric.rollout.tensor_parallel import check_model_splits
    from rlfabric.trainer.models import check_policy_model, check_teacher_tokenizer
    from rlfabric.trainer.tensor_parallel import check_splits as check_trainer_splits

    try:
        check_policy_model(config.model.path, config.model.trust_remote_code)
        if config.actor.lora.enabled:  # the adapters' targets and rank against the model's layers
            check_lora_fits(config.model.path, config.actor.lora, config.model.trust_remote_code)
        check_teacher_tokenizer(config)  # algorithm.distill: the teacher's tokenizer is the policy's
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_model_splits(config)  # rollout.tensor_parallel_size against the model's heads
    check_trainer_splits(config)  # actor/reference/critic.tensor_parallel_size against the model's
    pool = config.resource_pools.get(config.rollout.pool)
    rollout_gpus = pool.gpus_per_node if pool else torch.cuda.is_available()  # no pool: this machine's devices
    check_moe_settings(config, on_gpu=bool(rollout_gpus))


def plan_local(config: RunConfig, external: Mapping[str, Sequence[str]] | None = None) \
        -> tuple[dict[str, Placement], TransportChoice]:
    """Where each service but the coordinator runs on this machine, and the weight-sync transport it will
    get; a ConfigError naming the pool, or weight_sync.transport for nccl where it cannot run, when this
    machine cannot run the config."""
    gpu_count = visible_gpu_count()
    placements = plan_placement(config, service_names(config), gpu_count=gpu_count)
    return placements, predicted_transport(config, placed_devices(config, placements, gpu_count, external or {}))


def check_external(config: RunConfig, external: Mapping[str, Sequence[str]]) -> None:
    """Roles left to the user (`rlfabric up --external ROLE=ADDRESS`) must be roles this config runs,
    each with at least one address; the coordinator cannot be one (the launcher configures it)."""
    in_use = worker_roles(config)
    for role, addresses in external.items():
        if role not in in_use:
            raise ConfigError(f"--external {role}: not a role this config runs without the launcher "
                              f"(roles: {', '.join(in_use)})")
        if not addresses or not all(addresses):
            raise ConfigError(f"--external {role}: give its address as {role}=HOST:PORT")


def build_tiny_model(run_dir: Path) -> Path:
    """The quickstart's model, warm-started (rlfabric.quickstart.warm_start), in RUN_DIR/model: a copy of the
    machine's cached one (rlfabric.quickstart.cached), which a subprocess builds first if the cache lacks it
    (torch stays out of the launcher). A run dir that holds its model keeps it."""
    model_dir = run_dir / "model"
    if not (model_dir / "config.json").exists():
        if not cached.is_cached():
            subprocess.run([sys.executable, "-m", "rlfabric", "make-tiny-model", "--warm-start"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cached.copy_cached(0, model_dir)
    return model_dir.resolve()


def serve_command(role: str, config_path: Path, host: str, port_file: Path, run_id: str,
                  port: int = 0) -> list[str]:
    """`rlfabric serve ROLE` on `port` (0: any free port) and any free metrics port, which it reports in port_file."""
    return [
        sys.executable, "-m", "rlfabric", "serve", role,
        "--config", str(config_path),
        "--host", host, "--port", str(port), "--metrics-port", "0",
        "--port-file", str(port_file), "--run-id", run_id,
    ]


def await_port_file(port_file: Path, process: subprocess.Popen, timeout_s: float) -> dict | None:
    """The ports a `serve --port-file` process reported; None if it exited first, TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None:
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port file {port_file} after {timeout_s:g} s")
        time.sleep(0.05)
    return json.loads(port_file.read_text())


def endpoint(name: str, host: str, ports: dict) -> dict:
    """One entry of endpoints.json."""
    return {"name": name, "grpc": f"{host}:{ports['grpc']}", "metrics": f"{host}:{ports['metrics']}",
            "pid": ports["pid"]}


def write_endpoints(run_dir: Path, endpoints: dict[str, list[dict]]) -> None:
    """RUN_DIR/endpoints.json: role -> [{name, grpc, metrics, pid}], replaced atomically; and the services as
    Prometheus targets (rlfabric.launch.scrape_targets)."""
    tmp = run_dir / "endpoints.json.tmp"
    tmp.write_text(json.dumps(endpoints, indent=2))
    tmp.rename(run_dir / "endpoints.json")
    write_scrape_targets(run_dir, endpoints)


def write_coordinator_config(config: RunConfig, endpoints: dict[str, list[dict]], run_dir: Path) -> Path:
    """RUN_DIR/config.resolved.yaml: the config plus every role's addresses in its cluster section."""
    resolved = config.model_copy(deep=True)
    for role, entries in endpoints.items():
        setattr(resolved.cluster, role, [e["grpc"] for e in entries])
    path = run_dir / "config.resolved.yaml"
    dump_config(resolved, path)
    return path


async def await_readiness(config: RunConfig, services: list[LaunchedService]) -> None:
    """Waits until every service answers readiness SERVING over gRPC; a service that exits
    meanwhile fails the wait at once with an error naming it."""
    options = ChannelOptions.from_config(config)
    timeout = config.launcher.startup_timeout_s

    async def one(service: LaunchedService) -> None:
        waiting = asyncio.create_task(wait_until_serving(service.grpc_address, options, timeout_s=timeout))
        while not waiting.done():
            report = service.exit_report()
            if report is not None:
                waiting.cancel()
                raise MeshStartError(f"{service.name} {report} while loading:\n{service.log_tail()}")
            await asyncio.sleep(0.1)
        try:
            waiting.result()
        except Exception as error:
            raise MeshStartError(f"{service.name} never became ready: {error}\n{service.log_tail()}") from None

    await asyncio.gather(*(one(s) for s in services))


class MeshContext:
    """`with Mesh(...) as mesh:` starts it, and stops it on the way out (also when start fails)."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalMesh(MeshContext):
    """Starts and stops the roles the config uses on this machine, except the `external` ones (role ->
    addresses), which someone else serves there: the coordinator is configured with those addresses and
    waits for them when a run starts (client.connect_timeout_s)."""

    def __init__(self, config: RunConfig, run_dir: Path | None = None, host: str = "127.0.0.1",
                 external: Mapping[str, Sequence[str]] | None = None):
        self.config = config
        self.external = {role: list(addresses) for role, addresses in (external or {}).items()}
        check_external(config, self.external)
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(config)
        self.run_id = self.run_dir.name
        self.host = host
        self.processes: list[ServiceProcess] = []
        self.endpoints: dict[str, list[dict[str, str]]] = {}
        self.placements: dict[str, Placement] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the workers (the env and the judge replicas first: the rollout replicas and the reward once their
        addresses are in their config), then
        the coordinator (configured with their addresses); waits for all. Each phase logs its seconds;
        RUN_DIR/mesh_start.json records them."""
        phases = StartPhases("mesh", log)
        with phases.phase("placement"):
            self.placements, _ = plan_local(self.config, self.external)
        # The replicas' config names the environment they may call, the reward's the judge pool it calls.
        name_addresses(self.config, {role: addresses for role, addresses in self.external.items()
                                     if ROLE_TABLE[role].kind in (Kind.ENVIRONMENT, Kind.JUDGE)})
        worker_config = prepare_run_dir(self.config, self.run_dir, phases)
        with phases.phase("workers_bound"):  # started, and listening (their models load after that)
            (self.run_dir / "ports").mkdir(exist_ok=True)
            first, early, late = spawn_order([s for s in service_names(self.config) if s[1] not in self.external])
            for name, role in first + early:
                self._spawn(name, role, worker_config)
            started_first = [p for p in self.processes if (p.name, p.role) in first]
            for proc in started_first:
                self._await_ports(proc)
            if started_first:
                write_worker_config(self.config, worker_config, addresses_of(started_first))
            for name, role in late:
                self._spawn(name, role, worker_config)
            for proc in self.processes:
                if proc.ports is None:
                    self._await_ports(proc)
            self._record_endpoints()
        with phases.phase("coordinator_bound"):
            # The coordinator reads the others' addresses from its config's cluster section.
            external = {role: [{"name": f"{role}-{i}", "grpc": address} for i, address in enumerate(addresses)]
                        for role, addresses in self.external.items()}
            coordinator_config = write_coordinator_config(self.config, {**self.endpoints, **external}, self.run_dir)
            coordinator = self._spawn("coordinator", "coordinator", coordinator_config)
            self._await_ports(coordinator)
            self._record_endpoints()
        with phases.phase("readiness"):  # every model loaded
            asyncio.run(await_readiness(self.config, self.processes))
        phases.finish()
        phases.write(self.run_dir / "mesh_start.json")
        log.info("mesh ready", extra={"fields": {"run_dir": str(self.run_dir), "services": len(self.processes)}})

    def stop(self) -> None:
        """SIGTERM every service (coordinator first), wait for them to drain, SIGKILL stragglers."""
        remove_shared_targets(self.run_dir)
        for proc in reversed(self.processes):
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.launcher.stop_timeout_s
        for proc in reversed(self.processes):
            try:
                proc.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("killing service that did not drain", extra={"fields": {"service": proc.name}})
                proc.process.kill()
                proc.process.wait()

    def failed(self) -> list[ServiceProcess]:
        """Services whose process has exited."""
        return [p for p in self.processes if p.process.poll() is not None]

    def restart(self, name: str) -> ServiceProcess:
        """Starts the service `name` again after it exited (crashed, killed) on the gRPC port it had, so
        its peers reach it at the same address (a rollout replica rejoins the run at the next weight
        sync; see rlfabric.coordinator.weight_sync); returns once it answers readiness SERVING.
        Call it from a thread that lives as long as the mesh: a child gets SIGTERM when the thread that
        spawned it ends (PR_SET_PDEATHSIG)."""
        index, old = next((i, p) for i, p in enumerate(self.processes) if p.name == name)
        if old.process.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.process.pid}); stop it first")
        coordinator = ROLE_TABLE[old.role].kind is Kind.COORDINATOR
        config_path = self.run_dir / ("config.resolved.yaml" if coordinator else "config.yaml")
        proc = self._spawn(name, old.role, config_path, port=old.ports["grpc"] if old.ports else 0)
        self.processes.remove(proc)
        self.processes[index] = proc  # the same place: stop() still ends the coordinator first
        self._await_ports(proc)
        self._record_endpoints()
        asyncio.run(await_readiness(self.config, [proc]))
        log.info("service restarted", extra={"fields": {"service": name, "address": proc.grpc_address}})
        return proc

    # -- helpers -----------------------------------------------------------------------------

    def _spawn(self, name: str, role: str, config_path: Path, port: int = 0) -> ServiceProcess:
        log_path = self.run_dir / "logs" / f"{name}.log"
        port_file = self.run_dir / "ports" / f"{name}.json"
        port_file.unlink(missing_ok=True)
        command = serve_command(role, config_path, self.host, port_file, self.run_id, port)
        placement = self.placements.get(name) or Placement(
            name, role, "", None, None, threads_per_service(self.config, service_names(self.config), role))

        def start_child() -> None:
            die_with_parent()
            placement.pin()

        with open(log_path, "ab") as log_file:
            # A session of its own: Ctrl-C in the terminal reaches the launcher only, which stops the run
            # with a checkpoint before it stops the services.
            process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **placement.env()}, preexec_fn=start_child, start_new_session=True,
            )
        proc = ServiceProcess(name, role, process, log_path, port_file, host=self.host)
        self.processes.append(proc)
        return proc

    def _await_ports(self, proc: ServiceProcess) -> None:
        try:
            proc.ports = await_port_file(proc.port_file, proc.process, self.config.launcher.startup_timeout_s)
        except TimeoutError:
            raise MeshStartError(f"{proc.name} did not bind its ports within the startup timeout") from None
        if proc.ports is None:
            raise MeshStartError(
                f"{proc.name} exited with code {proc.process.returncode} before binding its ports; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )

    def _record_endpoints(self) -> None:
        endpoints: dict[str, list[dict]] = {}
        for proc in self.processes:
            if proc.ports is not None:
                endpoints.setdefault(proc.role, []).append(endpoint(proc.name, self.host, proc.ports))
        self.endpoints = endpoints
        write_endpoints(self.run_dir, endpoints)
