"""The gRPC server every rlfabric service runs on (kserve-style: the server owns the aio server,
message limits, health, reflection, metrics and graceful stop; servicers stay thin).

    service = ServiceDefinition(role="reward", bindings=[...], engine=engine)
    asyncio.run(serve(service, ServerOptions.from_config(config.server, port=50051)))

Lifecycle:
- start(): bind ports, serve health ("liveness" SERVING, "readiness" NOT_SERVING) and reflection,
  start /metrics, then `await engine.start()` (model load); readiness flips to SERVING after it.
  RPCs that arrive before that get UNAVAILABLE from the readiness interceptor.
- back-pressure: past server.max_concurrent_rpcs RPCs at once, more get RESOURCE_EXHAUSTED
  (interceptors.ConcurrencyLimitInterceptor); health and reflection always answer.
- message limits per method (rlfabric.core.message_limits): batches, prompts and weights up to
  server.max_receive_message_mb, anything else up to server.max_control_message_kb; gRPC's own
  limit is the largest method limit of the role, so a role without bulk methods (env, coordinator)
  refuses a big request before reading it.
- stop(): health NOT_SERVING everywhere, new RPCs refused, the service's on_drain (a rollout replica
  deregisters), in-flight RPCs get `grace_period_s` to finish, then the engine stops. SIGTERM/SIGINT trigger it; `serve()` then returns, exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from rlfabric.core import interceptors, tracing
from rlfabric.core.config import ConfigError, ServerConfig, TlsConfig, read_auth_token, read_named_file
from rlfabric.core.host import is_loopback
from rlfabric.core.message_limits import MessageLimits
from rlfabric.core.metrics import GrpcServerMetrics, MetricsEndpoint, start_metrics_endpoint

log = logging.getLogger("rlfabric.server")

LIVENESS = "liveness"
READINESS = "readiness"
MIB = 1024 * 1024


class Engine(Protocol):
    """What a service runs behind its servicer: loaded in start(), released in stop()."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class ServiceBinding:
    """One gRPC service of a role: the servicer and the generated add_*_to_server function."""

    servicer: Any
    add_to_server: Callable[[Any, aio.Server], None]
    full_name: str  # e.g. "rlfabric.v1.ActorService"


@dataclass
class ServiceDefinition:
    """A role's services, engine and metrics registry."""

    role: str
    bindings: list[ServiceBinding]
    engine: Engine
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    on_ready: Callable[[int], Awaitable[None]] | None = None  # once ready, with the bound gRPC port
    on_drain: Callable[[], Awaitable[None]] | None = None  # when it starts draining (refusing new RPCs)


@dataclass
class ServerOptions:
    """Where and how to serve; built from the config's `server` section plus CLI flags."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = 0
    health_port: int | None = None
    max_receive_bytes: int = 256 * MIB  # methods that carry batches, prompts or weights
    max_control_receive_bytes: int = 4 * MIB  # every other method
    max_send_bytes: int = 256 * MIB
    grace_period_s: float = 30.0
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    max_concurrent_rpcs: int = 256  # 0 = no limit; health and reflection are not counted
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth_token: str = ""
    allow_insecure: bool = False

    @classmethod
    def from_config(cls, server: ServerConfig, token: str | None = None, **overrides) -> ServerOptions:
        """`token`: the bearer token RPCs must carry; None = server.auth_token_file's (the mesh's). The env
        service passes env.auth_token_file's (rlfabric.core.config.read_env_token) and never reads the mesh's."""
        token = read_auth_token(server) if token is None else token
        options = cls(
            host=server.host,
            max_receive_bytes=server.max_receive_message_mb * MIB,
            max_control_receive_bytes=server.max_control_message_kb * 1024,
            max_send_bytes=server.max_send_message_mb * MIB,
            grace_period_s=server.grace_period_s,
            keepalive_time_s=server.keepalive_time_s,
            keepalive_timeout_s=server.keepalive_timeout_s,
            max_concurrent_rpcs=server.max_concurrent_rpcs,
            tls=server.tls,
            auth_token=token,
            allow_insecure=server.allow_insecure,
        )
        for key, value in overrides.items():
            if value is not None:
                setattr(options, key, value)
        return options

    def check_exposure(self) -> None:
        """A ConfigError when the service would listen beyond this machine without TLS and a token."""
        if is_loopback(self.host) or (self.tls.enabled and self.auth_token) or self.allow_insecure:
            return
        missing = " and ".join(what for what, there in (("TLS (server.tls.cert_file)", self.tls.enabled),
                                                        ("a token (server.auth_token_file)", self.auth_token))
                               if not there)
        raise ConfigError(
            f"refusing to serve on {self.host} without {missing}: anyone who can reach the port could drive "
            "the service, and a token would cross the network in clear. Configure both, bind 127.0.0.1, or "
            "set server.allow_insecure: true to accept the risk (e.g. a private network with a NetworkPolicy)")

    @property
    def message_limits(self) -> MessageLimits:
        return MessageLimits(self.max_receive_bytes, self.max_control_receive_bytes)

    def grpc_options(self, max_receive_bytes: int | None = None) -> list[tuple[str, Any]]:
        """The aio server's options; `max_receive_bytes`: gRPC's own request limit (default: the bulk one)."""
        return [
            ("grpc.max_receive_message_length", max_receive_bytes or self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.so_reuseport", 0),
        ]


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS credentials; with require_client_cert, clients must present a cert signed by ca_file.

    A renewed certificate (cert-manager rewrites the mounted Secret) is picked up without a restart:
    gRPC asks the fetcher before every new connection's handshake, and it rereads the files when they
    changed. Open connections keep the certificate they were set up with."""
    if tls.require_client_cert and not tls.ca_file:
        raise ConfigError("server.tls.require_client_cert needs server.tls.ca_file")
    files = CertificateFiles(tls)
    return grpc.dynamic_ssl_server_credentials(files.initial, files.changed_configuration,
                                               require_client_authentication=tls.require_client_cert)


class CertificateFiles:
    """The certificate, key and CA files of a server, reread when any of them changes."""

    def __init__(self, tls: TlsConfig):
        self.tls = tls
        self.initial = self.configuration()
        self.signature = self._signature()

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        tls = self.tls
        cert = read_named_file("server.tls.cert_file", tls.cert_file)
        key = read_named_file("server.tls.key_file", tls.key_file)
        ca = read_named_file("server.tls.ca_file", tls.ca_file) if tls.ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def changed_configuration(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration when a file changed since the last read, else None (keep the current)."""
        try:
            signature = self._signature()
            if signature == self.signature:
                return None
            configuration = self.configuration()
        except (OSError, ConfigError) as error:  # mid-rewrite, or removed: keep serving the current one
            log.warning("TLS files unreadable, keeping the current certificate: %s", error)
            return None
        self.signature = signature
        log.info("TLS certificate reloaded", extra={"fields": {"cert_file": self.tls.cert_file}})
        return configuration

    def _signature(self) -> tuple:
        paths = [p for p in (self.tls.cert_file, self.tls.key_file, self.tls.ca_file) if p]
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, paths))


class RlfabricServer:
    """One role's gRPC server, health, reflection and metrics endpoint."""

    def __init__(self, service: ServiceDefinition, options: ServerOptions):
        self.service = service
        self.options = options
        self.health = health_aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self._state = "starting"  # starting -> ready -> draining -> stopped
        self._server: aio.Server | None = None
        self._health_server: aio.Server | None = None
        self._metrics: MetricsEndpoint | None = None
        self._engine_task: asyncio.Task | None = None
        self.concurrency_limit: interceptors.ConcurrencyLimitInterceptor | None = None
        self.bound = asyncio.Event()  # set once every port is bound (before the engine loads)
        self.stopped = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self._state == "ready"

    def _describe_state(self) -> str:
        role = self.service.role
        if self._state == "starting":
            return f"{role} service is starting: its engine is still loading"
        return f"{role} service is shutting down"

    def _interceptors(self) -> list[aio.ServerInterceptor]:
        rpc_metrics = GrpcServerMetrics(self.service.registry)
        for name in [b.full_name for b in self.service.bindings] + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]:
            rpc_metrics.initialize(name)
        chain: list[aio.ServerInterceptor] = [*tracing.server_interceptors(), interceptors.MetricsInterceptor(rpc_metrics)]
        if self.options.auth_token:
            chain.append(interceptors.AuthInterceptor(self.options.auth_token))
        chain.append(interceptors.ReadinessInterceptor(lambda: self.ready, self._describe_state))
        if self.options.max_concurrent_rpcs:
            # Back-pressure in an interceptor, not grpc's maximum_concurrent_rpcs, which refuses health checks too.
            self.concurrency_limit = interceptors.ConcurrencyLimitInterceptor(
                self.options.max_concurrent_rpcs, self.service.role)
            chain.append(self.concurrency_limit)
        chain.append(interceptors.ErrorInterceptor(self.options.message_limits))
        return chain

    async def start(self) -> None:
        """Binds, serves health/reflection/metrics, loads the engine, then reports ready."""
        opts = self.options
        opts.check_exposure()
        names = [b.full_name for b in self.service.bindings]
        receive_limit = opts.message_limits.of_server(names)  # a bigger request is refused unread
        self._server = aio.server(interceptors=self._interceptors(), options=opts.grpc_options(receive_limit))
        for binding in self.service.bindings:
            binding.add_to_server(binding.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME], self._server)
        address = f"{opts.host}:{opts.port}"
        if opts.tls.enabled:
            self.port = self._server.add_secure_port(address, server_credentials(opts.tls))
        else:
            self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind gRPC port {address}")
        if opts.health_port is not None:
            # A plaintext health-only port for Kubernetes probes, which cannot do mTLS.
            self._health_server = aio.server(options=opts.grpc_options(opts.message_limits.of("")))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(f"{opts.host}:{opts.health_port}")
            await self._health_server.start()
        if opts.metrics_port is not None:
            self._metrics = start_metrics_endpoint(self.service.registry, opts.host, opts.metrics_port)
            self.metrics_port = self._metrics.port
        await self._set_health(liveness=True, readiness=False)
        await self._server.start()
        self.bound.set()
        log.info("serving", extra={"fields": {"role": self.service.role, "port": self.port,
                                              "metrics_port": self.metrics_port, "services": names,
                                              "tls": opts.tls.enabled, "client_certs": opts.tls.require_client_cert,
                                              "auth": bool(opts.auth_token)}})
        await self.service.engine.start()
        if self._state == "starting":
            self._state = "ready"
            await self._set_health(liveness=True, readiness=True)
            log.info("ready", extra={"fields": {"role": self.service.role}})
            if self.service.on_ready is not None:
                await self.service.on_ready(self.port)

    async def _set_health(self, liveness: bool, readiness: bool) -> None:
        status = health_pb2.HealthCheckResponse
        ready = status.SERVING if readiness else status.NOT_SERVING
        await self.health.set(LIVENESS, status.SERVING if liveness else status.NOT_SERVING)
        await self.health.set(READINESS, ready)
        await self.health.set("", ready)
        for binding in self.service.bindings:
            await self.health.set(binding.full_name, ready)

    async def stop(self, grace: float | None = None) -> None:
        """Drains: health NOT_SERVING, in-flight RPCs finish within the grace period, engine stops."""
        if self._state in ("draining", "stopped"):
            await self.stopped.wait()
            return
        self._state = "draining"
        grace = self.options.grace_period_s if grace is None else grace
        log.info("draining", extra={"fields": {"role": self.service.role, "grace_s": grace}})
        await self.health.enter_graceful_shutdown()
        if self.service.on_drain is not None:  # e.g. a rollout replica deregisters, so no new work is sent to it
            try:
                await self.service.on_drain()
            except Exception as error:  # the drain goes on: in-flight RPCs still get their grace period
                log.warning("on_drain failed: %s", error)
        if self._server is not None:
            await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        try:
            await self.service.engine.stop()
        finally:
            if self._metrics is not None:
                await self._metrics.aclose()
            self._state = "stopped"
            self.stopped.set()
            log.info("stopped", extra={"fields": {"role": self.service.role}})


async def serve(service: ServiceDefinition, options: ServerOptions, port_file: str | Path | None = None) -> None:
    """Runs a service until SIGTERM/SIGINT, then drains and returns (the process exits 0).

    port_file, when given, receives {"grpc": port, "metrics": port, "health": port, "pid": pid}
    once the ports are bound, so a launcher can use port 0 without races.
    """
    await serve_all([service], options, [port_file])


async def serve_all(services: list[ServiceDefinition], options: ServerOptions,
                    port_files: list[str | Path | None]) -> None:
    """Runs several services in this process, each a server with ports of its own (options.port + i when a port
    is fixed), until SIGTERM/SIGINT; then drains them all. Service i's ports go to port_files[i]. A service that
    fails to start stops them all and raises its error."""
    servers = [RlfabricServer(service, _nth(options, i)) for i, service in enumerate(services)]
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    starts = [asyncio.create_task(server.start()) for server in servers]
    try:
        # Ports are bound early in start(), before the engine loads; publish them as soon as they are.
        for server, start, port_file in zip(servers, starts, port_files, strict=True):
            bound = asyncio.create_task(server.bound.wait())
            await asyncio.wait({start, bound}, return_when=asyncio.FIRST_COMPLETED)
            bound.cancel()
            _raise_failed(start)
            if port_file:
                _write_port_file(Path(port_file), server)
        stopper = asyncio.create_task(stop_requested.wait())
        pending = {*starts, stopper}
        while stopper in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for start in done - {stopper}:
                _raise_failed(start)
    except BaseException:
        await asyncio.gather(*(server.stop(0) for server in servers))
        raise
    for start in starts:
        if not start.done():
            start.cancel()
    await asyncio.gather(*(server.stop() for server in servers))


def _nth(options: ServerOptions, index: int) -> ServerOptions:
    """The options of the index-th service of a process: fixed ports moved on by `index`."""
    if not index:
        return options
    return dataclasses.replace(options, **{name: getattr(options, name) + index
                                           for name in ("port", "metrics_port", "health_port")
                                           if getattr(options, name)})


def _raise_failed(start: asyncio.Task) -> None:
    if start.done() and not start.cancelled() and start.exception() is not None:
        raise start.exception()


def _write_port_file(path: Path, server: RlfabricServer) -> None:
    info = {"grpc": server.port, "metrics": server.metrics_port, "health": server.health_port, "pid": os.getpid()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.rename(path)
