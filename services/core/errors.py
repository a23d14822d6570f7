"""Domain errors shared by every service.

Engines and validators raise these; one server interceptor (rlfabric.core.interceptors)
turns each into its gRPC status code, so servicers never build statuses by hand. On the other
side, every client (rlfabric.core.client.ServiceClient.call) turns a status code back into its
class here (error_for_code), so a caller catches the same errors over gRPC as in process.
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


class Cancelled(RlfabricError):
    """The call was cancelled before it finished (the caller gave up, or the server is shutting down)."""

    code = grpc.StatusCode.CANCELLED


class Unknown(RlfabricError):
    """The server failed without saying how (e.g. an exception outside rlfabric's error handling)."""

    code = grpc.StatusCode.UNKNOWN


class AlreadyExists(RlfabricError):
    """The thing the request would create exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(RlfabricError):
    """The operation was aborted, typically by a concurrent one; a retry of the whole sequence may work."""

    code = grpc.StatusCode.ABORTED


class OutOfRange(RlfabricError):
    """A position or index past the valid range (e.g. reading past the end)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Internal(RlfabricError):
    """A failure the server did not expect (a bug; the server logged it)."""

    code = grpc.StatusCode.INTERNAL


class DataLoss(RlfabricError):
    """Data was lost or corrupted beyond recovery."""

    code = grpc.StatusCode.DATA_LOSS


# One class per status code, read off the classes above (subclasses elsewhere, e.g. a ChecksumMismatch
# that is an InvalidArgument, do not take over their code).
_CLASS_OF_CODE: dict[grpc.StatusCode, type[RlfabricError]] = {
    cls.code: cls for cls in RlfabricError.__subclasses__() if cls.__module__ == __name__}



# Most bytes of error details on the wire. They travel as the grpc-message trailer, percent-encoded
# (anything outside printable ASCII takes 3 bytes per UTF-8 byte), and gRPC clients refuse trailers of
# more than 8-16 KiB (the call then fails with "metadata size exceeds hard limit", its message lost).
MAX_DETAILS_BYTES = 4096


def shorten(text: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """text, or its start and end around a note of what was cut, within `limit` bytes as the grpc-message
    trailer encodes them: a message that quotes a huge input still says what was wrong, and stays small."""
    costs = [1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "replace")) for char in text]
    if sum(costs) <= limit:
        return text
    budget = (limit - 64) // 2  # 64: the note
    head = tail = spent = 0
    while spent + costs[head] <= budget:
        spent, head = spent + costs[head], head + 1
    spent = 0
    while spent + costs[-1 - tail] <= budget:
        spent, tail = spent + costs[-1 - tail], tail + 1
    return f"{text[:head]} [... {len(text) - head - tail} characters cut ...] {text[len(text) - tail:]}"


def error_for_code(code: grpc.StatusCode, message: str) -> RlfabricError:
    """The domain error of a gRPC status code: the class above whose `code` it is. (Every code but OK
    has one; OK, which no failure carries, gives an Unknown.)"""
    return _CLASS_OF_CODE.get(code, Unknown)(message)
