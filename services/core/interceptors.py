"""Server interceptors shared by every service, outermost first:

0. rlfabric.core.tracing.ServerTracingInterceptor, only while tracing is on (config `tracing`).
1. MetricsInterceptor   records grpc_server_* metrics for every RPC, rejected ones included.
2. AuthInterceptor      checks the bearer token (health and reflection exempt), when configured.
3. ReadinessInterceptor answers UNAVAILABLE while the engine loads or the server drains.
4. ConcurrencyLimitInterceptor answers RESOURCE_EXHAUSTED while server.max_concurrent_rpcs RPCs run
                        (health and reflection exempt), when a limit is set.
5. ErrorInterceptor     maps domain errors to status codes; a full disk to RESOURCE_EXHAUSTED; unexpected
                        errors to INTERNAL (logged). Details and their log line are capped (errors.shorten).
                        A request that is not a valid protobuf message of the method's type
                        (random bytes, bad UTF-8 in a string field) is INVALID_ARGUMENT; one larger
                        than its method's limit (rlfabric.core.message_limits) RESOURCE_EXHAUSTED,
                        unparsed. It sets the status rather than raising (context.abort): an exception
                        in flight keeps the request alive through its traceback until a garbage
                        collection, and a refused large request would stay resident until then.

Each wraps the method handler's behaviour in an async context manager (`wrap_handler`), so
the four RPC kinds (unary/streaming in and out) share one code path.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from rlfabric.core import message_limits
from rlfabric.core.errors import InvalidArgument, ResourceExhausted, RlfabricError, shorten
from rlfabric.core.message_limits import MessageLimits
from rlfabric.core.metrics import GrpcServerMetrics
from rlfabric.core.storage import out_of_space

log = logging.getLogger("rlfabric.rpc")

# Services that must answer without auth and before the engine is ready (probes, tooling).
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_HANDLER_KINDS = {
    (False, False): ("unary", "unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("server_stream", "unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("client_stream", "stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("bidi_stream", "stream_stream", grpc.stream_stream_rpc_method_handler),
}

Scope = Callable[[aio.ServicerContext], contextlib.AbstractAsyncContextManager]


def rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """"unary", "server_stream", "client_stream" or "bidi_stream", as go-grpc-prometheus names them."""
    if isinstance(handler, _Refusal):
        return handler.kind
    return _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)][0]


def is_open(method: str) -> bool:
    return method.startswith(OPEN_SERVICES)


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class _BadRequest:
    """What a request that is too large, or does not parse as the method's message type, deserializes to.

    gRPC runs the deserializer before any interceptor code, and an error raised there reaches the
    client as UNKNOWN; the lenient deserializer returns this instead, and the wrapped behaviour raises
    the error inside the ErrorInterceptor's scope.
    """

    def __init__(self, error: RlfabricError):
        self.error = error

    def check(self) -> None:
        raise self.error


def _lenient(deserializer: Callable[[bytes], Any], max_bytes: int | None) -> Callable[[bytes], Any]:
    def deserialize(data: bytes):
        message_limits.note_request_size(len(data))
        if max_bytes is not None and len(data) > max_bytes:
            return _BadRequest(ResourceExhausted(
                f"request of {len(data)} bytes is larger than this method's limit of {max_bytes} bytes "
                "(server.max_control_message_kb; batches, prompts and weights: server.max_receive_message_mb)"))
        try:
            return deserializer(data)
        except DecodeError as error:
            return _BadRequest(InvalidArgument(f"the request is not a valid protobuf message of this method's "
                                               f"type: {error}"))

    return deserialize


async def _checked_stream(requests):
    """A request stream that raises at the first message that was too large or did not parse."""
    async for request in requests:
        if isinstance(request, _BadRequest):
            request.check()
        yield request


def _check_decoded(request_or_iterator, streaming: bool):
    if streaming:
        return _checked_stream(request_or_iterator)
    if isinstance(request_or_iterator, _BadRequest):
        request_or_iterator.check()
    return request_or_iterator


def wrap_handler(
    handler: grpc.RpcMethodHandler | None, scope: Scope, check_decoding: bool = False,
    max_request_bytes: int | None = None,
) -> grpc.RpcMethodHandler | None:
    """Returns a handler that runs the original behaviour inside `async with scope(context)`.

    check_decoding: deserialize leniently and raise, inside the scope, InvalidArgument for a request
    that is not a valid message and ResourceExhausted, unparsed, for one over `max_request_bytes` (the
    ErrorInterceptor's job).
    """
    if handler is None:
        return None
    _, attr, factory = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    behaviour = getattr(handler, attr)
    deserializer = handler.request_deserializer
    check_decoding = check_decoding and deserializer is not None
    if check_decoding:
        deserializer = _lenient(deserializer, max_request_bytes)

    def request_of(request_or_iterator):
        if not check_decoding:
            return request_or_iterator
        return _check_decoded(request_or_iterator, handler.request_streaming)

    if handler.response_streaming:

        async def wrapped(request_or_iterator, context):
            async with scope(context):
                responses = behaviour(request_of(request_or_iterator), context)
                if hasattr(responses, "__aiter__"):
                    async for response in responses:
                        yield response
                else:
                    for response in await _maybe_await(responses):
                        yield response
    else:

        async def wrapped(request_or_iterator, context):
            async with scope(context):
                return await _maybe_await(behaviour(request_of(request_or_iterator), context))

    return factory(wrapped, request_deserializer=deserializer, response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class _Refusal(grpc.RpcMethodHandler):
    """A handler that fails every call with code/details without reading its request.

    It takes the request as a stream it never iterates (the wire format is the same for every kind),
    so a refused caller, one without a token say, cannot make the server receive and decode a message
    of up to server.max_receive_message_mb first: HTTP/2 flow control stops the sender after one window.
    """

    code: grpc.StatusCode
    details: str
    kind: str  # the refused method's own kind ("unary", ...), for the metrics labels
    response_streaming: bool
    request_streaming: bool = True
    request_deserializer: None = None
    response_serializer: None = None
    unary_unary: None = None
    unary_stream: None = None

    async def stream_unary(self, requests, context):
        await context.abort(self.code, self.details)

    async def stream_stream(self, requests, context):
        await context.abort(self.code, self.details)
        yield  # pragma: no cover - abort always raises


def _abort_handler(code: grpc.StatusCode, details: str, like: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler for the method of `like` that fails every call with code/details, unread (_Refusal)."""
    return _Refusal(code, details, rpc_type(like), like.response_streaming)


class MetricsInterceptor(aio.ServerInterceptor):
    """Counts and times every RPC with go-grpc-prometheus names and labels."""

    def __init__(self, metrics: GrpcServerMetrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        _, service, method = handler_call_details.method.split("/", 2)
        labels = (rpc_type(handler), service, method)
        metrics = self.metrics

        @contextlib.asynccontextmanager
        async def measure(context):
            metrics.started.labels(*labels).inc()
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                yield
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                if code == grpc.StatusCode.OK and context.code() not in (None, grpc.StatusCode.OK):
                    code = context.code()
                metrics.handled.labels(*labels, code.name).inc()
                metrics.handling_seconds.labels(*labels).observe(time.perf_counter() - start)

        return wrap_handler(handler, measure)


class AuthInterceptor(aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every RPC except health and reflection."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("AuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open(handler_call_details.method):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return handler
        reason = "missing bearer token" if not given else "invalid bearer token"
        return _abort_handler(grpc.StatusCode.UNAUTHENTICATED, reason, handler)


class ReadinessInterceptor(aio.ServerInterceptor):
    """Refuses work with UNAVAILABLE until `is_ready()` holds (engine loaded, not draining)."""

    def __init__(self, is_ready: Callable[[], bool], describe: Callable[[], str]):
        self.is_ready = is_ready
        self.describe = describe

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open(handler_call_details.method) or self.is_ready():
            return handler
        return _abort_handler(grpc.StatusCode.UNAVAILABLE, self.describe(), handler)


class ConcurrencyLimitInterceptor(aio.ServerInterceptor):
    """Refuses an RPC with RESOURCE_EXHAUSTED while `limit` others run (server.max_concurrent_rpcs).

    Health and reflection are exempt and not counted, so probes answer under any load. Why not
    grpc.aio.server(maximum_concurrent_rpcs=...): it counts and refuses health checks too (a
    saturated service would fail its liveness probe and be restarted), it refuses before any
    interceptor runs (grpc_server_* metrics never see those calls), and its message names no
    setting. The price: a refused unary call's request has been received by then (not handled).
    """

    def __init__(self, limit: int, role: str):
        if limit < 1:
            raise ValueError(f"ConcurrencyLimitInterceptor needs a limit >= 1 (got {limit})")
        self.limit = limit
        self.role = role
        self.active = 0  # RPCs running now; the event loop's thread alone changes it

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open(handler_call_details.method):
            return handler

        @contextlib.asynccontextmanager
        async def admit(context):
            if self.active >= self.limit:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the {self.role} service is running {self.active} RPCs, its limit "
                    f"(server.max_concurrent_rpcs={self.limit}): retry with backoff, spread the load over "
                    "more replicas, or raise server.max_concurrent_rpcs (0 = no limit)",
                )
            self.active += 1
            try:
                yield
            finally:
                self.active -= 1

        return wrap_handler(handler, admit)


class ErrorInterceptor(aio.ServerInterceptor):
    """Domain errors -> their status code; NotImplementedError -> UNIMPLEMENTED; the rest -> INTERNAL.
    With `limits`, a request over its method's limit is RESOURCE_EXHAUSTED before it is parsed."""

    def __init__(self, limits: MessageLimits | None = None):
        self.limits = limits

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method

        @contextlib.asynccontextmanager
        async def map_errors(context):
            try:
                yield
            except RlfabricError as error:
                self._refuse(context, method, error.code, str(error))
            except NotImplementedError as error:
                _fail(context, grpc.StatusCode.UNIMPLEMENTED, shorten(str(error) or f"{method} is not implemented"))
            except (aio.AbortError, grpc.RpcError):
                message_limits.release_after_failure()
                raise
            except Exception as error:  # the server must keep serving whatever a handler does
                if out_of_space(error):  # a write the handler did not expect to fail
                    self._refuse(context, method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"the disk is full: {type(error).__name__}: {error}")
                    return
                log.exception("unexpected error", extra={"fields": {"method": method}})
                _fail(context, grpc.StatusCode.INTERNAL,
                      shorten(f"internal error in {method}: {type(error).__name__}: {error}"))

        limit = self.limits.of(method) if self.limits else None
        return wrap_handler(handler, map_errors, check_decoding=True, max_request_bytes=limit)

    @staticmethod
    def _refuse(context, method: str, code: grpc.StatusCode, message: str) -> None:
        """Logs and answers a refusal, its message shortened: one quoting a huge input (a path, a value)
        must not become a huge reply or log line."""
        details = shorten(message)
        log.info("rpc failed", extra={"fields": {"method": method, "code": code.name, "error": details}})
        _fail(context, code, details)


def _fail(context: aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """Ends the RPC with code and details without raising (see the module doc), and has a large
    request's memory returned to the kernel once the RPC is over."""
    context.set_code(code)
    context.set_details(details)
    message_limits.release_after_failure()


def bearer_metadata(token: str | None) -> tuple[tuple[str, Any], ...]:
    """Client-side metadata for AuthInterceptor."""
    return (("authorization", f"Bearer {token}"),) if token else ()
