"""One error path for every client: a failed call raises the rlfabric.core.errors class of its status
code, naming the role, the address and the call. Real gRPC servers on loopback throughout."""

from __future__ import annotations

import grpc

from rlfabric.core import errors

FAILURE_CODES = [code for code in grpc.StatusCode if code != grpc.StatusCode.OK]


def test_every_status_code_has_its_own_domain_error_class():
    # A subclass elsewhere (ChecksumMismatch is an InvalidArgument) must not take over its parent's code.
    import rlfabric.core.weight_sync.buckets  # noqa: F401

    classes = {code: type(errors.error_for_code(code, "x")) for code in FAILURE_CODES}
    assert all(cls.__module__ == errors.__name__ for cls in classes.values()), classes
    assert all(cls.code == code for code, cls in classes.items()), classes
    assert len(set(classes.values())) == len(FAILURE_CODES)
    assert classes[grpc.StatusCode.INVALID_ARGUMENT] is errors.InvalidArgument
    assert classes[grpc.StatusCode.UNAUTHENTICATED] is errors.Unauthenticated
    assert classes[grpc.StatusCode.PERMISSION_DENIED] is errors.PermissionDenied
