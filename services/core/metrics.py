"""Prometheus metrics: the go-grpc-prometheus RPC metrics plus each service's `rlfabric_*` metrics.

Each server owns a CollectorRegistry (so several servers can live in one test process) and
exposes it over HTTP on its own port at /metrics. Names follow Prometheus conventions: base
units, `_total` counters, no unbounded label values.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Buckets from 1 ms to ~5 min: RPCs here range from health checks to whole PPO updates.
RPC_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GrpcServerMetrics:
    """grpc_server_started_total, grpc_server_handled_total and grpc_server_handling_seconds."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter(
            "grpc_server_started_total", "RPCs started on the server.", labels, registry=registry
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, regardless of success or failure.",
            [*labels, "grpc_code"],
            registry=registry,
        )
        self.handling_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Response latency of RPCs handled by the server.",
            labels,
            buckets=RPC_SECONDS_BUCKETS,
            registry=registry,
        )

    def initialize(self, service_full_name: str) -> None:
        """Creates every method's series at 0 (each status code too), as go-grpc-prometheus's
        InitializeMetrics does: a series born at 1 by the first RPC hides that RPC from rate()."""
        service = descriptor_pool.Default().FindServiceByName(service_full_name)
        for method in service.methods:
            kind = {(False, False): "unary", (False, True): "server_stream", (True, False): "client_stream",
                    (True, True): "bidi_stream"}[(method.client_streaming, method.server_streaming)]
            labels = (kind, service_full_name, method.name)
            self.started.labels(*labels)
            self.handling_seconds.labels(*labels)
            for code in grpc.StatusCode:
                self.handled.labels(*labels, code.name)


@dataclass
class MetricsEndpoint:
    """A running /metrics HTTP server."""

    host: str
    port: int
    _httpd: object

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    async def aclose(self) -> None:
        """close() on a thread of its own: shutdown() waits up to the HTTP server's poll interval (0.5 s), and
        a process serving many replicas closes their endpoints at once, not one pool slot at a time."""
        loop = asyncio.get_running_loop()
        closed = loop.create_future()

        def close() -> None:
            try:
                self.close()
            finally:
                loop.call_soon_threadsafe(closed.set_result, None)

        threading.Thread(target=close, name="metrics-close", daemon=True).start()
        await closed


def start_metrics_endpoint(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serves the registry at http://host:port/metrics (port 0 picks a free port)."""
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsEndpoint(host=host, port=httpd.server_port, _httpd=httpd)


def service_gauge(registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    """A gauge in the service's registry (a helper so engines need not import prometheus_client)."""
    return Gauge(name, doc, list(labels), registry=registry)


def service_counter(registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    """A counter in the service's registry; name it with the `_total` suffix."""
    return Counter(name.removesuffix("_total"), doc, list(labels), registry=registry)


def service_histogram(
    registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = (), buckets=RPC_SECONDS_BUCKETS
) -> Histogram:
    """A histogram in the service's registry."""
    return Histogram(name, doc, list(labels), buckets=buckets, registry=registry)
