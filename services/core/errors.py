"""Domain errors shared by every service.

Engines and validators raise these; one server interceptor (rlfabric.core.interceptors)
turns each into its gRPC status code, so servicers never build statuses by hand.
"""

from __future__ import annotations

import grpc


class RlfabricError(Exception):
    """Base class: an error with a gRPC status code and a message that says what was wrong."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(RlfabricError, ValueError):
    """The request itself is wrong (shape, dtype, value range): the caller must fix it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(RlfabricError):
    """The request is well-formed but the service is not in a state to do it (e.g. no sync group)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RlfabricError):
    """Too large or too many: back off or send less."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RlfabricError):
    """The engine or a peer is down or not ready yet; retrying later may work."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RlfabricError):
    """An operation (a collective, a scorer) ran past its time limit."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(RlfabricError):
    """A named thing (checkpoint, sync group, scorer) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class Unimplemented(RlfabricError):
    """The engine behind this service does not support the call."""

    code = grpc.StatusCode.UNIMPLEMENTED
