"""Client side of the mesh: channels with limits, keepalive, retry policy and TLS, and the base class
of the gRPC clients of every role (every call carries a deadline and the auth token, and every failure
comes back as the rlfabric.core.errors class of its status code, naming the role and the address).
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.core import errors, tracing
from rlfabric.core.config import (
    ClientConfig,
    ConfigError,
    RunConfig,
    TlsConfig,
    read_auth_token,
    read_env_token,
    read_named_file,
)
from rlfabric.core.interceptors import bearer_metadata

MIB = 1024 * 1024
# Calls never retried on UNAVAILABLE: a failed attempt may have done part of the work (an optimizer
# step, a run start, a collective that lost a peer, a join), and a repeat would apply it twice or
# wait for peers that have moved on. Their callers decide what a failure means.
NO_RETRY_METHODS = (
    ("rlfabric.v1.ActorService", "UpdatePolicy"),
    ("rlfabric.v1.ActorService", "UpdatePolicyStream"),
    ("rlfabric.v1.CriticService", "UpdateValues"),
    ("rlfabric.v1.CoordinatorService", "StartRun"),
    ("rlfabric.v1.ActorService", "BroadcastWeights"),
    ("rlfabric.v1.RolloutService", "JoinWeightSyncGroup"),
    ("rlfabric.v1.RolloutService", "ReceiveWeights"),
    ("rlfabric.v1.RolloutService", "PushWeights"),
    ("rlfabric.v1.ReferenceService", "JoinWeightSyncGroup"),
    ("rlfabric.v1.ReferenceService", "ReceiveWeights"),
)


@dataclass
class ChannelOptions:
    """How clients reach a service."""

    timeout_s: float = 600.0
    connect_timeout_s: float = 60.0
    max_message_bytes: int = 256 * MIB
    retry_max_attempts: int = 5
    retry_initial_backoff_s: float = 0.2
    keepalive_time_s: float = 30.0
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth_token: str = ""

    @classmethod
    def from_config(cls, config: RunConfig) -> ChannelOptions:
        client: ClientConfig = config.client
        return cls(
            timeout_s=client.timeout_s,
            connect_timeout_s=client.connect_timeout_s,
            max_message_bytes=max(config.server.max_receive_message_mb, config.server.max_send_message_mb) * MIB,
            retry_max_attempts=client.retry_max_attempts,
            retry_initial_backoff_s=client.retry_initial_backoff_s,
            keepalive_time_s=config.server.keepalive_time_s,
            tls=config.server.tls,
            auth_token=read_auth_token(config.server),
        )

    @classmethod
    def for_env(cls, config: RunConfig) -> ChannelOptions:
        """To the environment service: as from_config, with the environment's own token
        (env.auth_token_file) instead of the mesh's, which must not reach an environment (a ConfigError
        when the file holds the mesh's token)."""
        options = cls.from_config(config)
        token = read_env_token(config)
        if token and token == options.auth_token:
            raise ConfigError("env.auth_token_file holds the mesh's token (server.auth_token_file): an environment "
                              "must get a token of its own, which authorises nothing else")
        return replace(options, auth_token=token)

    def service_config(self) -> str:
        """gRPC service config: retry every method on UNAVAILABLE with exponential backoff.

        gRPC rejects a retryPolicy with maxAttempts < 2, so one attempt means no policy at all.
        """
        method_config: dict = {"name": [{}]}
        if self.retry_max_attempts >= 2:
            method_config["retryPolicy"] = {
                "maxAttempts": self.retry_max_attempts,
                "initialBackoff": f"{self.retry_initial_backoff_s}s",
                "maxBackoff": "5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            }
        configs = [method_config]
        if self.retry_max_attempts >= 2:  # a method's own entry overrides the catch-all one
            configs.append({"name": [{"service": service, "method": method} for service, method in NO_RETRY_METHODS]})
        return json.dumps({"methodConfig": configs})

    def grpc_options(self) -> list[tuple[str, Any]]:
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.enable_retries", 1 if self.retry_max_attempts > 1 else 0),
            ("grpc.service_config", self.service_config()),
            # gRPC's reconnect backoff grows to 120 s by default: a peer restarted after a long outage
            # would then sit unused for up to two minutes. 5 s keeps reconnecting prompt and cheap.
            ("grpc.max_reconnect_backoff_ms", 5_000),
        ]
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """TLS credentials: verify the server with ca_file; present cert/key for mTLS when given."""
    ca = read_named_file("server.tls.ca_file", tls.ca_file) if tls.ca_file else None
    key = read_named_file("server.tls.key_file", tls.key_file) if tls.key_file else None
    cert = read_named_file("server.tls.cert_file", tls.cert_file) if tls.cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(address: str, options: ChannelOptions | None = None) -> aio.Channel:
    """An aio channel to `address` ("host:port"), secure when options.tls has a CA or cert."""
    options = options or ChannelOptions()
    traced = tracing.client_interceptors(address) or None  # None while tracing is off: a plain channel
    if options.tls.ca_file or options.tls.cert_file:
        return aio.secure_channel(address, channel_credentials(options.tls), options=options.grpc_options(),
                                  interceptors=traced)
    return aio.insecure_channel(address, options=options.grpc_options(), interceptors=traced)


class RoleInterface(ABC):
    """What every role's interface has besides its RPCs: the role's name and close(). Each role's client.py
    defines <Role>Interface on it, implemented over gRPC (<Role>Client) and in this process (Local<Role>Client)."""

    role: str

    @abstractmethod
    async def close(self) -> None:
        """Releases the connection (or whatever the implementation holds)."""


class ServiceClient:
    """Base of the gRPC clients: owns a channel and a stub. `call` and `stream` add the deadline and the
    auth token, and turn every failed call into the domain error of its status code (see domain_error).

    A subclass implements a role's interface (e.g. rlfabric.actor.client.ActorInterface), which gives
    it its `role` ("actor", "rollout", ...), and names the stub; its typed methods are the only callers
    of `call` and `stream`.
    """

    stub_class: type = object
    role: str  # from the role's interface

    def __init__(self, address: str, options: ChannelOptions | None = None):
        self.address = address
        self.options = options or ChannelOptions()
        self.channel = open_channel(address, self.options)
        self.stub = self.stub_class(self.channel)
        self._metadata = bearer_metadata(self.options.auth_token)

    async def call(self, method: str, request, timeout_s: float | None = None):
        """Unary call with the default (or given) deadline."""
        timeout_s = timeout_s or self.options.timeout_s
        rpc = getattr(self.stub, method)
        try:
            return await rpc(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self.domain_error(error, method, timeout_s) from None

    async def call_serialized(self, service: str, method: str, request: bytes, response_class,
                              timeout_s: float | None = None):
        """`call` with the request already serialized (codec.serialized_with_batch: bulk tensors written once,
        straight from their memory); `service` is its full name ("rlfabric.v1.ActorService")."""
        timeout_s = timeout_s or self.options.timeout_s
        rpc = self.channel.unary_unary(f"/{service}/{method}", request_serializer=None,  # already bytes
                                       response_deserializer=response_class.FromString)
        try:
            return await rpc(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self.domain_error(error, method, timeout_s) from None

    async def call_client_stream(self, method: str, requests: AsyncIterator, timeout_s: float | None = None):
        """Client-streaming call (the requests sent as `requests` yields them) with a deadline over the whole
        call."""
        timeout_s = timeout_s or self.options.timeout_s
        try:
            return await getattr(self.stub, method)(requests, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self.domain_error(error, method, timeout_s) from None

    async def stream(self, method: str, request, timeout_s: float | None = None) -> AsyncIterator:
        """Server-streaming call with a deadline over the whole stream; the call is cancelled when the
        caller stops iterating."""
        timeout_s = timeout_s or self.options.timeout_s
        call = getattr(self.stub, method)(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as error:
            raise self.domain_error(error, method, timeout_s) from None
        finally:
            call.cancel()

    def domain_error(self, error: grpc.RpcError, method: str, timeout_s: float) -> errors.RlfabricError:
        """The rlfabric.core.errors class of the status code, its message naming the code, the role,
        the address and the method (and the deadline, for DEADLINE_EXCEEDED), then the server's words:
        "UNAVAILABLE: actor at 10.0.0.5:50051 (UpdatePolicy): failed to connect to all addresses"."""
        code = error.code()
        deadline = f", deadline {timeout_s:g} s" if code == grpc.StatusCode.DEADLINE_EXCEEDED else ""
        message = f"{code.name}: {self.role} at {self.address} ({method}{deadline}): {error.details()}"
        return errors.error_for_code(code, message)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


async def check_health(channel: aio.Channel, service: str = "readiness", timeout_s: float = 5.0) -> int:
    """One health check; returns the HealthCheckResponse status enum value."""
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return response.status


async def wait_until_serving(
    address: str, options: ChannelOptions | None = None, service: str = "readiness", timeout_s: float = 120.0
) -> None:
    """Polls the health service until `service` is SERVING; DeadlineExceeded after timeout_s, with the
    last check's answer (e.g. UNAVAILABLE: ... Connection refused)."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    # One attempt per check: this loop is the retry, and gRPC's own retries would hide a refused
    # connection behind DEADLINE_EXCEEDED.
    options = replace(options or ChannelOptions(), retry_max_attempts=1)
    async with open_channel(address, options) as channel:
        while time.monotonic() < deadline:
            try:
                status = await check_health(channel, service, timeout_s=min(5.0, max(0.1, deadline - time.monotonic())))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = f"status {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            except grpc.RpcError as error:
                last_error = f"{error.code().name}: {error.details()}"
            await asyncio.sleep(0.2)
    raise errors.DeadlineExceeded(f"{address} did not report {service} SERVING within {timeout_s:.0f} s ({last_error})")

