"""An OTLP/gRPC trace receiver for tests: a real gRPC server on loopback built on the collector's
TraceService protos, keeping every span it is sent with its service's name."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # resource attribute service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int = 0  # unix time in nanoseconds
    end_ns: int = 0
    links: tuple[ReceivedLink, ...] = ()


@dataclass(frozen=True)
class ReceivedLink:
    """A span link: the span it points to (in another trace) and its attributes."""

    trace_id: str  # hex
    span_id: str
    attributes: dict


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`with OtlpReceiver() as receiver:` serves on receiver.endpoint; receiver.spans() lists what came."""

    def __init__(self):
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes}, status_code=span.status.code,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        links=tuple(ReceivedLink(link.trace_id.hex(), link.span_id.hex(),
                                                 {a.key: _value(a.value) for a in link.attributes})
                                    for link in span.links)))
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(0)
