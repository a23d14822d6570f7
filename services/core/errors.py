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


class Unauthenticated(RlfabricError):
    """The call carried no valid credentials (bearer token, client certificate)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RlfabricError):
    """The caller is known but not allowed to do this (e.g. a path outside the storage root)."""

    code = grpc.StatusCode.PERMISSION_DENIED


def error_for_code(code: grpc.StatusCode, message: str) -> RlfabricError:
    """The domain error of a gRPC status code (the inverse of each class's `code`): a code with no class
    of its own keeps its code on a plain RlfabricError, so it is never reported as INTERNAL."""
    by_code = {cls.code: cls for cls in _all_subclasses(RlfabricError)}
    error_class = by_code.get(code)
    if error_class is not None:
        return error_class(message)
    error = RlfabricError(message)
    error.code = code
    return error


def _all_subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_all_subclasses(direct))]
