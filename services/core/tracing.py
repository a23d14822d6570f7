"""OpenTelemetry traces of the mesh (config `tracing`): one trace per training step, every RPC in it.

- `setup(config, role)` runs once per service process: a tracer provider that exports over OTLP/gRPC
  to tracing.endpoint through a BatchSpanProcessor; `shutdown()` flushes it when the service stops.
  With an empty endpoint nothing is set up: `active()` is false, servers and channels get no
  interceptor, and StepSpan, `phase_span` and `annotate` do nothing.
- ServerTracingInterceptor: a SERVER span per RPC (streams included: the span lasts as long as the
  stream), whose parent is the caller's span carried in the W3C `traceparent`/`tracestate` gRPC
  metadata. The span is the current one while the handler runs, so the RPCs the handler makes (the
  actor's weight push to the rollouts, say) are its children.
- client_interceptors: a CLIENT span per RPC made on a channel of rlfabric.core.client (and on the
  weight-sync push channels), whose context goes out in that metadata.
- The coordinator's StepTimer (rlfabric.coordinator.step_metrics) opens a root span per training step
  and a child span per timed phase, so a phase's timing_s metric and its span are one measurement.
  Generation running ahead of its step (trainer.mode async) is a trace of its own (`own_trace`), which
  the step that trains on it links to (`StepSpan.link`, OpenTelemetry span links).

Why interceptors of our own rather than opentelemetry-instrumentation-grpc: the server side is one
more scope over the interceptor chain's shared handler wrapper (rlfabric.core.interceptors), so it
covers refused calls (auth, readiness, back-pressure) and all four RPC kinds the way the metrics do,
with no monkey-patching of grpc and no further dependencies; health checks and reflection are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import grpc
from grpc import aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rlfabric.core.config import TracingConfig, read_named_file
from rlfabric.core.interceptors import is_open, wrap_handler

log = logging.getLogger("rlfabric.tracing")

TRACER_NAME = "rlfabric"
# Attribute names: OpenTelemetry's RPC conventions for the calls, rlfabric.* for the run's own facts.
STEP = "rlfabric.step"
PHASE = "rlfabric.phase"

_propagator = TraceContextTextMapPropagator()
_provider = None  # the SDK TracerProvider while tracing is on
_tracer: trace.Tracer | None = None


def active() -> bool:
    """Whether this process traces (setup() ran with an endpoint)."""
    return _tracer is not None


def setup(config: TracingConfig, role: str) -> bool:
    """Starts exporting this process's spans as service `<prefix><role>`; False (and nothing set up)
    when config.endpoint is empty. The SDK and the exporter are imported here, only when tracing is on."""
    global _provider, _tracer
    if not config.endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    credentials = None
    if not config.insecure:
        ca = read_named_file("tracing.ca_file", config.ca_file) if config.ca_file else None
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    exporter = OTLPSpanExporter(endpoint=config.endpoint, insecure=config.insecure, credentials=credentials)
    resource = Resource.create({"service.name": f"{config.service_name_prefix}{role}", "rlfabric.role": role})
    # A trace is kept or dropped where it starts (a step's root span); every other service follows the caller.
    _provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer(TRACER_NAME)
    log.info("tracing on", extra={"fields": {"endpoint": config.endpoint, "service": f"{config.service_name_prefix}{role}",
                                             "sample_ratio": config.sample_ratio}})
    return True


def shutdown() -> None:
    """Exports the spans still queued, then stops tracing in this process."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = None, None


# -- spans of the training loop ----------------------------------------------------------------------

class StepSpan:
    """The root span of one training step; its phases are children (`phase_span`). Ends with `end`."""

    def __init__(self, step: int | None):
        self.span = None
        self.trace_id = ""  # hex, while tracing and the trace is sampled: what a metric's exemplar links to
        if _tracer is not None and step is not None:
            # A root of its own: a step's trace must not hang under whatever RPC or task started it.
            self.span = _tracer.start_span("train_step", context=otel_context.Context(),
                                           attributes={STEP: step})
            span_context = self.span.get_span_context()
            if span_context.trace_flags.sampled:
                self.trace_id = trace.format_trace_id(span_context.trace_id)

    @property
    def recording(self) -> bool:
        """Whether the span is there to take attributes (tracing on, the step's span not ended)."""
        return self.span is not None

    def set(self, **attributes: Any) -> None:
        """rlfabric.<name> attributes on the step's span."""
        if self.span is not None:
            self.span.set_attributes(_named(attributes))

    def link(self, context: trace.SpanContext | None, **attributes: Any) -> None:
        """A span link from the step to `context`, a span whose work the step uses (the `generate` span of
        generation that ran ahead of it: own_trace), with rlfabric.<name> attributes; none to a span of
        the step's own trace."""
        if self.span is None or context is None:
            return
        if context.trace_id != self.span.get_span_context().trace_id:
            self.span.add_link(context, _named(attributes))

    def end(self, error: BaseException | None = None) -> None:
        if self.span is None:
            return
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.end()
        self.span = None


@contextlib.contextmanager
def phase_span(step: StepSpan, phase: str) -> Iterator[None]:
    """A child span of the step named after the phase, current while the phase runs: RPCs made in it are
    its children. Attach and detach happen in one task (the timer's `with` or `timed` call)."""
    if step.span is None:
        yield
        return
    parent = trace.set_span_in_context(step.span)
    with _tracer.start_as_current_span(phase, context=parent, attributes={PHASE: phase}):
        yield


@contextlib.contextmanager
def own_trace(name: str, **attributes: Any) -> Iterator[trace.SpanContext | None]:
    """A root span `name` (rlfabric.<name> attributes), current while the block runs, for work done before
    the step that uses it is known (generation running ahead of training): the RPCs made in the block hang
    under it, and the step links to it (StepSpan.link). Yields its span context, None while tracing is off.
    Attach and detach happen in one task. Cancelled, the span says so (rlfabric.cancelled) without an error."""
    if _tracer is None:
        yield None
        return
    span = _tracer.start_span(name, context=otel_context.Context(), attributes=_named(attributes))
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span.get_span_context()
    except asyncio.CancelledError:
        span.set_attribute("rlfabric.cancelled", True)
        raise
    except BaseException as error:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        raise
    finally:
        otel_context.detach(token)
        span.end()


def current_span_context() -> trace.SpanContext | None:
    """The context of the current span (a phase's, a handler's), for a step to link to; None when tracing is off
    or there is none."""
    if _tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def annotate(**attributes: Any) -> None:
    """rlfabric.<name> attributes on the current span (a phase's, a handler's); nothing when tracing is off."""
    if _tracer is not None:
        span = trace.get_current_span()
        if span.is_recording():  # not an ended one (a task can outlive the RPC that started it)
            span.set_attributes(_named(attributes))


def _named(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"rlfabric.{name}": _attribute_value(value) for name, value in attributes.items() if value is not None}


def _attribute_value(value: Any):
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set):
        return [str(item) for item in (sorted(value) if isinstance(value, set) else value)]
    return str(value)


# -- gRPC ----------------------------------------------------------------------------------------------

def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _end_rpc_span(span, code: grpc.StatusCode | None, details: str = "") -> None:
    code = code or grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
    span.end()


class ServerTracingInterceptor(aio.ServerInterceptor):
    """A SERVER span per RPC, child of the caller's span from the metadata; the outermost interceptor."""

    def __init__(self, tracer: trace.Tracer):
        self.tracer = tracer

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open(method):
            return handler
        parent = _propagator.extract(dict(handler_call_details.invocation_metadata or ()))
        tracer = self.tracer

        @contextlib.asynccontextmanager
        async def traced(context):
            span = tracer.start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                                     attributes=_rpc_attributes(method))
            token = otel_context.attach(trace.set_span_in_context(span, parent))
            code = None
            try:
                yield
                code = context.code() or grpc.StatusCode.OK
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                otel_context.detach(token)
                _end_rpc_span(span, code, context.details() or "")

        return wrap_handler(handler, traced)


class _ClientTracing:
    """A CLIENT span per RPC, its context sent in the call's metadata. grpc.aio files an interceptor
    under the first of the four kinds it implements, hence one subclass per kind."""

    streams_responses = False

    def __init__(self, tracer: trace.Tracer, address: str):
        self.tracer = tracer
        host, _, port = address.rpartition(":")
        self.peer: dict[str, Any] = {"server.address": host or address}
        if port.isdigit():
            self.peer["server.port"] = int(port)
        self._ending: set[asyncio.Task] = set()

    def _start(self, details: aio.ClientCallDetails):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if is_open(method):
            return None, details
        span = self.tracer.start_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                      attributes={**_rpc_attributes(method), **self.peer})
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(span))
        metadata = aio.Metadata(*tuple(details.metadata or ()), *carrier.items())
        return span, details._replace(metadata=metadata)

    async def _intercept(self, continuation, details, request):
        """A call with one response ends its span before the caller has the response; a response
        stream, whose caller reads at its own pace, ends it once the call is done (_end_when_done)."""
        span, details = self._start(details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
            if self.streams_responses:
                self._end_when_done(span, call)
            else:
                _end_rpc_span(span, await call.code(), await call.details())
            return call
        except asyncio.CancelledError:
            _end_rpc_span(span, grpc.StatusCode.CANCELLED)
            raise
        except BaseException as error:
            _end_rpc_span(span, error.code() if isinstance(error, grpc.RpcError) else None, str(error))
            raise

    def _end_when_done(self, span, call) -> None:
        async def end(done_call):
            try:  # the call is done: its status is there, these return at once
                code, details = await done_call.code(), await done_call.details()
            except asyncio.CancelledError:
                code, details = grpc.StatusCode.CANCELLED, "cancelled"
            _end_rpc_span(span, code, details)

        def on_done(done_call):
            task = asyncio.get_running_loop().create_task(end(done_call))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

        call.add_done_callback(on_done)


class _UnaryUnary(_ClientTracing, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_ClientTracing, aio.UnaryStreamClientInterceptor):
    streams_responses = True

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_ClientTracing, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_ClientTracing, aio.StreamStreamClientInterceptor):
    streams_responses = True

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


CLIENT_INTERCEPTOR_KINDS = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)


def server_interceptors() -> list[aio.ServerInterceptor]:
    """[ServerTracingInterceptor] while tracing is on, else []."""
    return [ServerTracingInterceptor(_tracer)] if _tracer is not None else []


def client_interceptors(address: str) -> list[aio.ClientInterceptor]:
    """The client interceptors of a channel to `address`, one per RPC kind, while tracing is on; else []."""
    return [kind(_tracer, address) for kind in CLIENT_INTERCEPTOR_KINDS] if _tracer is not None else []
