"""The Ray launcher: every service under a Ray actor that holds its resources (`rlfabric up --launcher ray`).

    with RayMesh(config, run_dir, address="ray-head:6379") as mesh:   # same surface as LocalMesh
        mesh.endpoints["rollout"][0]["grpc"]                          # "10.0.3.7:43121"

Each service is one named Ray actor (a ServiceSupervisor) in the run's namespace. The actor reserves
the role's `launcher.ray.<role>` num_cpus/num_gpus and runs `rlfabric serve ROLE` as its child process,
the entry point the local mesh and the containers run, so the services still speak gRPC to each other;
Ray only places and supervises them. Why a child process rather than the service inside the actor:
- resources: the child inherits the actor's environment, so it sees exactly the GPUs Ray assigned
  (CUDA_VISIBLE_DEVICES, emptied when the role reserved none) and the OMP_NUM_THREADS Ray derived from num_cpus;
- failures: the actor's wait() returns when the child exits, and a dead actor (or node) fails that call,
  so the launcher sees both; the child gets SIGTERM when the actor dies (PR_SET_PDEATHSIG);
- the service keeps its own process, signals and graceful drain, unchanged from the other launchers.

Resource pools (resource_pools, <role>.pool) are placement groups, reserved before the services are placed;
rlfabric.launch.ray_placement says which bundle each service goes into and what it asks Ray for. Each service
reports its Ray node id and the GPU ids Ray assigned it (RUN_DIR/endpoints.json). With rollout.engine sim the
replicas of one node of the rollout's pool run in one `rlfabric serve rollout --replicas` process (a Ray actor
named rollout-host-<first replica>, holding what they would reserve together), so hundreds of simulated replicas
cost a process per node, not one each.

Addresses: on a one-node cluster services bind 127.0.0.1; on a multi-node cluster (or through Ray Client)
each binds and advertises its node's IP. The coordinator is placed on the launcher's node, so RUN_DIR
(metrics, checkpoints) is where `rlfabric train` ran. With an address (or RAY_ADDRESS) the launcher connects
to that cluster and leaves it running; otherwise it starts a private local Ray instance and shuts it down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import yaml
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlfabric.core.config import RunConfig, read_auth_token, read_env_token
from rlfabric.core.roles import ROLE_TABLE, Kind
from rlfabric.core.storage import create_private_file
from rlfabric.launch.local import (
    MeshContext,
    MeshStartError,
    await_port_file,
    await_readiness,
    default_run_dir,
    die_with_parent,
    endpoint,
    log_tail,
    prepare_run_dir,
    serve_command,
    service_names,
    write_coordinator_config,
    write_endpoints,
)
from rlfabric.launch.placement import predicted_transport
from rlfabric.launch.ray_placement import (
    node_of,
    pool_bundles,
    pool_gpu_share,
    requested_gpus,
    reserve_pools,
    reserved_devices,
    rollout_hosts,
)
from rlfabric.launch.scrape_targets import remove_shared_targets
from rlfabric.launch.start_order import addresses_of, spawn_order, write_worker_config

log = logging.getLogger("rlfabric.launch.local")


def with_local_token(config_text: str, token: str, workdir: Path, env_token: str = "", role: str = "") -> str:
    """The config text with server.auth_token_file and env.auth_token_file pointing at 0600 copies of the
    mesh's and the environment link's tokens in workdir: on another node the launcher's RUN_DIR/auth_token
    and env_token do not exist. The env service gets its own token only, never the mesh's."""
    config = yaml.safe_load(config_text)
    environment = role in ROLE_TABLE and ROLE_TABLE[role].kind is Kind.ENVIRONMENT
    for section, name, value in (("server", "auth_token", token), ("env", "env_token", env_token)):
        if environment and section == "server":
            config.setdefault(section, {})["auth_token_file"] = ""
        elif value:
            config.setdefault(section, {})["auth_token_file"] = str(create_private_file(workdir / name, value))
    return yaml.safe_dump(config, sort_keys=False)


@ray.remote(max_concurrency=4)  # stop() and log_tail() answer while wait() blocks
class ServiceSupervisor:
    """One `rlfabric serve ROLE` process on this actor's node, holding the role's Ray resources."""

    def __init__(self, name: str, role: str, config_path: str, config_text: str, run_dir: str, run_id: str,
                 host: str | None, cwd: str, token: str = "", env_token: str = "", replicas: range | None = None):
        """replicas: the rollout replicas this one process serves (rollout_hosts), None for one service."""
        self.name = name
        self.replicas = replicas
        self.host = host or ray.util.get_node_ip_address()
        run_dir_here = Path(run_dir)
        self.workdir: Path | None = None
        if (run_dir_here / "logs").is_dir():
            # One machine or a shared filesystem: the local mesh's layout in RUN_DIR.
            self.log_path = run_dir_here / "logs" / f"{name}.log"
            self.port_file = run_dir_here / "ports" / (f"{role}-{{replica}}.json" if replicas else f"{name}.json")
            self.port_file.parent.mkdir(exist_ok=True)
        else:
            # Another node: a private directory; stop() hands the log back to the launcher.
            self.workdir = Path(tempfile.mkdtemp(prefix=f"rlfabric-{run_id}-{name}-"))
            config_path = str(self.workdir / Path(config_path).name)
            Path(config_path).write_text(with_local_token(config_text, token, self.workdir, env_token, role))
            self.log_path = self.workdir / f"{name}.log"
            self.port_file = self.workdir / ("ports-{replica}.json" if replicas else "ports.json")
        for path in self._port_files():
            path.unlink(missing_ok=True)
        env = dict(os.environ)
        if not ray.get_gpu_ids():
            env["CUDA_VISIBLE_DEVICES"] = ""  # Ray leaves it unset for 0 GPUs; a service uses what it reserved
        command = serve_command(role, Path(config_path), self.host, self.port_file, run_id)
        if replicas:
            command += ["--replica", str(replicas.start), "--replicas", str(len(replicas)),
                        "--replica-stride", str(replicas.step)]
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                command,
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=cwd if Path(cwd).is_dir() else None, preexec_fn=die_with_parent,
            )

    def node_ip(self) -> str:
        """Answers once the actor is placed and its service process started."""
        return ray.util.get_node_ip_address()

    def assigned_resources(self) -> dict[str, float]:
        return ray.get_runtime_context().get_assigned_resources()

    def placement_group_id(self) -> str | None:
        """The placement group (resource pool) this actor runs in; None outside any."""
        return ray.get_runtime_context().get_placement_group_id()

    def _port_files(self) -> list[Path]:
        if not self.replicas:
            return [self.port_file]
        return [Path(str(self.port_file).replace("{replica}", str(replica))) for replica in self.replicas]

    def await_ports(self) -> dict:
        """{grpc, metrics, pid, host, log, node_id} once the service bound its ports, or {exit_code, log} if it
        exited first. node_id: the Ray node this actor, and so its service process, runs on. Serving several
        replicas, the first one's ports and {replicas: {replica number: its ports}}."""
        served = {}
        for replica, path in zip(self.replicas or [None], self._port_files(), strict=True):
            ports = await_port_file(path, self.process, timeout_s=float("inf"))
            if ports is None:
                return {"exit_code": self.process.returncode, "log": str(self.log_path)}
            served[replica] = ports
        first = next(iter(served.values()))
        replicas = {"replicas": {str(r): p for r, p in served.items()}} if self.replicas else {}
        return {**first, **replicas, "host": self.host, "log": str(self.log_path),
                "node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def wait(self) -> int:
        """Blocks until the service process exits; its exit code."""
        return self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, timeout_s: float) -> tuple[int, str | None]:
        """SIGTERM, up to timeout_s to drain, then SIGKILL. (exit code, the log when it is node-local)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        node_log = None
        if self.workdir is not None:
            node_log = self.log_path.read_text(errors="replace")
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.process.returncode, node_log


@dataclass
class RayService:
    """The launcher's handle on one service: its Ray actor and what it reported."""

    name: str
    role: str
    actor: ray.actor.ActorHandle
    resources: dict[str, float]  # {"num_cpus": ..., "num_gpus": ...} as requested
    placed: ray.ObjectRef  # node_ip(): ready once the actor is placed
    ports: dict | None = None  # {grpc, metrics, pid, host, log}
    exited: ray.ObjectRef | None = None  # wait(): ready once the service process exits
    replicas: list[str] = field(default_factory=list)  # the rollout replicas it serves, when several
    _exit_report: str | None = None

    @property
    def grpc_address(self) -> str:
        return f"{self.ports['host']}:{self.ports['grpc']}"

    def exit_report(self) -> str | None:
        """Why the service is gone, or None while it runs."""
        if self._exit_report is None and self.exited is not None and ray.is_initialized() \
                and ray.wait([self.exited], timeout=0)[0]:
            try:
                code = ray.get(self.exited)
                self._exit_report = f"exited with code {code} (log {self.ports['log']} on {self.ports['host']})"
            except ray.exceptions.RayActorError as error:
                self._exit_report = f"lost its Ray actor: {_first_line(error)}"
        return self._exit_report

    def log_tail(self, lines: int = 20) -> str:
        try:
            return ray.get(self.actor.log_tail.remote(lines), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return "(no log: the service's Ray actor is gone)"

    def is_placed(self) -> bool:
        return bool(ray.wait([self.placed], timeout=0)[0])

    def served(self) -> list[ServedReplica | RayService]:
        """What answers gRPC: the service itself, or each of the replicas it serves."""
        if not self.replicas:
            return [self]
        return [ServedReplica(name, f"{self.ports['host']}:{self.ports['replicas'][name.rpartition('-')[2]]['grpc']}",
                              self) for name in self.replicas]


@dataclass
class ServedReplica:
    """One rollout replica of a process that serves several, as the readiness wait sees it."""

    name: str
    grpc_address: str
    process: RayService

    def exit_report(self) -> str | None:
        return self.process.exit_report()

    def log_tail(self, lines: int = 20) -> str:
        return self.process.log_tail(lines)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class RayMesh(MeshContext):
    """Starts and stops the roles the config uses as Ray actors; the same surface as LocalMesh."""

    def __init__(self, config: RunConfig, run_dir: Path | None = None, address: str | None = None):
        self.config = config
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(config)
        self.run_id = self.run_dir.name
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.namespace = config.launcher.ray.namespace or f"rlfabric-{self.run_id}"
        self.services: list[RayService] = []
        self.endpoints: dict[str, list[dict]] = {}
        self._disconnect = False  # this mesh called ray.init, so stop() calls ray.shutdown
        self._host: str | None = None  # where services bind: 127.0.0.1, or None for each node's IP
        self.pools: dict[str, PlacementGroup] = {}  # resource pool -> its placement group

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the workers (the env and the judge replicas first: the rollout replicas and the reward once their
        addresses are in their config), then
        the coordinator (configured with their addresses); waits for all."""
        bundles = pool_bundles(self.config)  # a pool with more nodes than services: refused before anything starts
        worker_config = prepare_run_dir(self.config, self.run_dir)
        self._connect()
        has_gpus = bool(ray.cluster_resources().get("GPU", 0))
        predicted_transport(self.config, reserved_devices(self.config, has_gpus))  # a forced nccl that cannot run
        self._host = self._service_host()
        # self.pools fills as the groups are made, so stop() removes them also when the reservation fails
        reserve_pools(self.pools, bundles, self.namespace, self.config.launcher.startup_timeout_s)
        first, early, late = spawn_order(service_names(self.config))
        for name, role in first + early:
            self._launch(name, role, worker_config)
        started_first = [s for s in self.services if (s.name, s.role) in first]
        if started_first:
            self._await_ports(started_first)
            write_worker_config(self.config, worker_config, addresses_of(started_first))
        rollouts = [service for service in late if ROLE_TABLE[service[1]].kind is Kind.ROLLOUT]
        for replicas in rollout_hosts(self.config, rollouts):
            (name, role), *_ = replicas
            self._launch(name, role, worker_config, replicas if len(replicas) > 1 else [])
        for name, role in late:
            if (name, role) not in rollouts:
                self._launch(name, role, worker_config)
        self._await_ports([s for s in self.services if s.ports is None])
        self._record_endpoints()
        # The coordinator reads the others' addresses from its config's cluster section.
        coordinator_config = write_coordinator_config(self.config, self.endpoints, self.run_dir)
        self._launch("coordinator", "coordinator", coordinator_config)
        self._await_ports(self.services[-1:])
        self._record_endpoints()
        asyncio.run(await_readiness(self.config, [served for s in self.services for served in s.served()]))
        log.info("mesh ready", extra={"fields": {"run_dir": str(self.run_dir), "services": len(self.services),
                                                 "namespace": self.namespace}})

    def stop(self) -> None:
        """SIGTERM every service through its actor, wait for them to drain, then kill the actors."""
        remove_shared_targets(self.run_dir)
        if not ray.is_initialized():
            return
        timeout = self.config.launcher.stop_timeout_s
        placed = [s for s in reversed(self.services) if s.is_placed()]
        stops = {s.actor.stop.remote(timeout): s for s in placed}
        ready, _ = ray.wait(list(stops), num_returns=len(stops), timeout=timeout + 10)
        for ref in ready:
            try:
                _, node_log = ray.get(ref)
            except ray.exceptions.RayActorError:
                continue
            if node_log is not None:
                (self.run_dir / "logs" / f"{stops[ref].name}.log").write_text(node_log)
        for service in self.services:
            ray.kill(service.actor)
        self.services = []
        self._await_actors_gone(timeout_s=10)
        for group in self.pools.values():
            remove_placement_group(group)
        self.pools = {}
        if self._disconnect:
            ray.shutdown()
            self._disconnect = False

    def failed(self) -> list[RayService]:
        """Services whose process (or Ray actor) is gone."""
        return [s for s in self.services if s.exit_report() is not None]

    def resources(self, name: str, role: str) -> dict[str, float]:
        """What service `name` of `role` asks Ray for (launcher.ray.<role>, null num_gpus resolved; in a pool,
        its share of its node's GPUs)."""
        spec = getattr(self.config.launcher.ray, role)
        num_gpus = requested_gpus(self.config, role, bool(ray.cluster_resources().get("GPU", 0)))
        if self.config.pool_of(role) and num_gpus:
            num_gpus = pool_gpu_share(self.config, name, role, num_gpus)
        return {"num_cpus": spec.num_cpus, "num_gpus": num_gpus}

    # -- helpers -----------------------------------------------------------------------------

    def _connect(self) -> None:
        if ray.is_initialized():
            return  # the caller's connection (a test, a Ray job's own driver): leave it to them
        self._disconnect = True
        # ray.init makes SIGTERM exit the process at once; keep the caller's handler (`rlfabric up` drains).
        on_sigterm = signal.getsignal(signal.SIGTERM)
        if self.address:
            ray.init(address=self.address)
        else:
            # A private instance for this mesh only: its logical CPUs are sized so every service fits,
            # as on one machine the local mesh runs them all too.
            roles = [role for _, role in service_names(self.config)] + ["coordinator"]
            needed = math.ceil(sum(getattr(self.config.launcher.ray, role).num_cpus for role in roles))
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)

    def _service_host(self) -> str | None:
        """127.0.0.1 on a one-node cluster; None (each service's node IP) otherwise."""
        if self.address and self.address.startswith("ray://"):
            return None  # Ray Client: the launcher is not on a node
        alive = [node for node in ray.nodes() if node["Alive"]]
        return "127.0.0.1" if len(alive) == 1 else None

    def _launch(self, name: str, role: str, config_path: Path, replicas: list[tuple[str, str]] = ()) -> None:
        """One service's Ray actor; with `replicas` (rollout_hosts), one process serving them all, named
        rollout-host-<first>, which reserves what they would together."""
        resources = self.resources(name, role)
        served = None
        if replicas:
            shares = [self.resources(replica, role) for replica, _ in replicas]
            resources = {key: sum(share[key] for share in shares) for key in resources}
            numbers = [int(replica.rpartition("-")[2]) for replica, _ in replicas]
            served = range(numbers[0], numbers[-1] + 1, numbers[1] - numbers[0])
            if list(served) != numbers:
                raise ValueError(f"replicas {numbers} are not evenly spaced")  # pool_nodes deals them i mod nodes
            name = f"{role}-host-{numbers[0]}"
        options = {"name": name, "namespace": self.namespace, **resources}
        if self.config.pool_of(role):
            pool, node, _ = node_of(self.config, replicas[0][0] if replicas else name, role)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pools[pool], placement_group_bundle_index=node)
        if ROLE_TABLE[role].kind is Kind.COORDINATOR and not (self.address or "").startswith("ray://"):
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        actor = ServiceSupervisor.options(**options).remote(
            name, role, str(config_path.resolve()), config_path.read_text(), str(self.run_dir.resolve()),
            self.run_id, self._host, os.getcwd(), read_auth_token(self.config.server), read_env_token(self.config),
            served)
        self.services.append(RayService(name, role, actor, resources, placed=actor.node_ip.remote(),
                                        replicas=[replica for replica, _ in replicas]))

    def _await_ports(self, services: list[RayService]) -> None:
        timeout = self.config.launcher.startup_timeout_s
        deadline = time.monotonic() + timeout
        pending = {s.actor.await_ports.remote(): s for s in services}
        while pending:
            # A service that bound its ports and then exited (while loading) fails the start at once.
            started = {s.exited: s for s in self.services if s.exited is not None}
            ready, _ = ray.wait([*pending, *started], num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise MeshStartError(self._not_started(list(pending.values()), timeout))
            if ready[0] in started:
                service = started[ready[0]]
                raise MeshStartError(f"{service.name} {service.exit_report()} while loading:\n{service.log_tail()}")
            service = pending.pop(ready[0])
            try:
                info = ray.get(ready[0])
            except ray.exceptions.RayActorError as error:
                raise MeshStartError(f"{service.name}: its Ray actor died before the service started: "
                                     f"{_first_line(error)}") from None
            if "exit_code" in info:
                raise MeshStartError(f"{service.name} exited with code {info['exit_code']} before binding its "
                                     f"ports; log {info['log']}:\n{service.log_tail()}")
            service.ports = info
            service.exited = service.actor.wait.remote()

    def _not_started(self, pending: list[RayService], timeout: float) -> str:
        unplaced = [s for s in pending if not s.is_placed()]
        if unplaced:
            service = unplaced[0]
            free = ray.available_resources()
            return (f"{service.name} was not placed on the Ray cluster within {timeout:g} s: it asks for "
                    f"{service.resources}; free now: CPU {free.get('CPU', 0):g}, GPU {free.get('GPU', 0):g}")
        service = pending[0]
        return f"{service.name} did not bind its ports within {timeout:g} s; log:\n{service.log_tail()}"

    def _await_actors_gone(self, timeout_s: float) -> None:
        """ray.kill returns before the cluster has recorded the kill; wait for the run's names to go."""
        deadline = time.monotonic() + timeout_s
        while any(a["namespace"] == self.namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            if time.monotonic() > deadline:
                log.warning("Ray actors of the run still listed after stop", extra={"fields": {"namespace": self.namespace}})
                return
            time.sleep(0.1)

    def _record_endpoints(self) -> None:
        endpoints: dict[str, list[dict]] = {}
        for service in self.services:
            if service.ports is None:
                continue
            served = service.ports.get("replicas") or {"": service.ports}
            for number, ports in served.items():
                name = f"{service.role}-{number}" if number else service.name
                endpoints.setdefault(service.role, []).append(
                    {**endpoint(name, service.ports["host"], ports), "node_id": service.ports["node_id"],
                     "gpu_ids": service.ports["gpu_ids"]})
        for role, entries in endpoints.items():
            if ROLE_TABLE[role].kind is Kind.ROLLOUT:  # in replica order, as the local launcher lists them
                entries.sort(key=lambda entry: int(entry["name"].rpartition("-")[2]))
        self.endpoints = endpoints
        write_endpoints(self.run_dir, endpoints)
