"""The local mesh: every role as its own process on loopback (`rlfabric up` / `rlfabric train`).

    with LocalMesh(config, run_dir) as mesh:    # starts, waits for readiness, writes endpoints.json
        mesh.endpoints["rollout"][0]["grpc"]    # "127.0.0.1:43121"

Services bind port 0 and report their ports through RUN_DIR/ports/<name>.json (no port races).
Logs go to RUN_DIR/logs/<name>.log. Children get SIGTERM if the launcher dies (PR_SET_PDEATHSIG),
and stop() terminates, then kills, every child: no orphans.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rlfabric.core.client import ChannelOptions, wait_until_serving
from rlfabric.core.config import RunConfig, dump_config

log = logging.getLogger("rlfabric.launcher")

_PR_SET_PDEATHSIG = 1


def default_run_dir(config: RunConfig) -> Path:
    """runs/<name>-<timestamp>"""
    return Path("runs") / f"{config.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
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

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class MeshStartError(RuntimeError):
    """A service of the mesh failed to start or to become ready."""


class LocalMesh:
    """Starts and stops the six roles on this machine."""

    def __init__(self, config: RunConfig, run_dir: Path | None = None, host: str = "127.0.0.1"):
        self.config = config
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(config)
        self.run_id = self.run_dir.name
        self.host = host
        self.processes: list[ServiceProcess] = []
        self.endpoints: dict[str, list[dict[str, str]]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LocalMesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def worker_names(self) -> list[tuple[str, str]]:
        """(process name, role) for every service except the coordinator."""
        names = [("actor", "actor")]
        if self.config.reference.enable:
            names.append(("reference", "reference"))
        names.append(("critic", "critic"))
        names += [(f"rollout-{i}", "rollout") for i in range(self.config.rollout.replicas)]
        names.append(("reward", "reward"))
        return names

    def start(self) -> None:
        """Starts the workers, then the coordinator (configured with their addresses); waits for all."""
        for sub in ("logs", "ports"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        if not self.config.model.path:
            self.config.model.path = str(self._build_tiny_model())
        worker_config = self.run_dir / "config.yaml"
        dump_config(self.config, worker_config)
        for name, role in self.worker_names():
            self._spawn(name, role, worker_config)
        for proc in self.processes:
            self._await_ports(proc)
        self._record_endpoints()
        # The coordinator reads the others' addresses from its config's cluster section.
        cluster = {role: [e["grpc"] for e in entries] for role, entries in self.endpoints.items()}
        resolved = self.config.model_copy(deep=True)
        for role, addresses in cluster.items():
            setattr(resolved.cluster, role, addresses)
        coordinator_config = self.run_dir / "config.resolved.yaml"
        dump_config(resolved, coordinator_config)
        coordinator = self._spawn("coordinator", "coordinator", coordinator_config)
        self._await_ports(coordinator)
        self._record_endpoints()
        asyncio.run(self._await_readiness())
        log.info("mesh ready", extra={"fields": {"run_dir": str(self.run_dir), "services": len(self.processes)}})

    def stop(self) -> None:
        """SIGTERM every service (coordinator first), wait for them to drain, SIGKILL stragglers."""
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

    # -- helpers -----------------------------------------------------------------------------

    def _build_tiny_model(self) -> Path:
        """The quickstart's model: built once per run dir (no model hub is needed)."""
        model_dir = self.run_dir / "model"
        if not (model_dir / "config.json").exists():
            subprocess.run(
                [sys.executable, "-m", "rlfabric", "make-tiny-model", str(model_dir)],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        return model_dir.resolve()

    def _spawn(self, name: str, role: str, config_path: Path) -> ServiceProcess:
        log_path = self.run_dir / "logs" / f"{name}.log"
        port_file = self.run_dir / "ports" / f"{name}.json"
        port_file.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "rlfabric", "serve", role,
            "--config", str(config_path),
            "--host", self.host, "--port", "0", "--metrics-port", "0",
            "--port-file", str(port_file), "--run-id", self.run_id,
        ]
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        proc = ServiceProcess(name, role, process, log_path, port_file)
        self.processes.append(proc)
        return proc

    def _await_ports(self, proc: ServiceProcess) -> None:
        deadline = time.monotonic() + self.config.launcher.startup_timeout_s
        while not proc.port_file.exists():
            if proc.process.poll() is not None:
                raise MeshStartError(
                    f"{proc.name} exited with code {proc.process.returncode} before binding its ports; "
                    f"log {proc.log_path}:\n{proc.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise MeshStartError(f"{proc.name} did not bind its ports within the startup timeout")
            time.sleep(0.05)
        proc.ports = json.loads(proc.port_file.read_text())

    def _record_endpoints(self) -> None:
        endpoints: dict[str, list[dict[str, str]]] = {}
        for proc in self.processes:
            if proc.ports is None:
                continue
            endpoints.setdefault(proc.role, []).append(
                {
                    "name": proc.name,
                    "grpc": f"{self.host}:{proc.ports['grpc']}",
                    "metrics": f"{self.host}:{proc.ports['metrics']}",
                    "pid": proc.ports["pid"],
                }
            )
        self.endpoints = endpoints
        tmp = self.run_dir / "endpoints.json.tmp"
        tmp.write_text(json.dumps(endpoints, indent=2))
        tmp.rename(self.run_dir / "endpoints.json")

    async def _await_readiness(self) -> None:
        options = ChannelOptions.from_config(self.config)
        timeout = self.config.launcher.startup_timeout_s

        async def one(proc: ServiceProcess) -> None:
            address = f"{self.host}:{proc.ports['grpc']}"
            waiting = asyncio.create_task(wait_until_serving(address, options, timeout_s=timeout))
            while not waiting.done():
                if proc.process.poll() is not None:
                    waiting.cancel()
                    raise MeshStartError(
                        f"{proc.name} exited with code {proc.process.returncode} while loading; "
                        f"log {proc.log_path}:\n{proc.log_tail()}"
                    )
                await asyncio.sleep(0.1)
            try:
                waiting.result()
            except Exception as error:
                raise MeshStartError(f"{proc.name} never became ready: {error}\n{proc.log_tail()}") from None

        await asyncio.gather(*(one(p) for p in self.processes))
