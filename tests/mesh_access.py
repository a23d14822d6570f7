"""How tests reach a mesh started by `rlfabric up`/`train`: every RPC but health and reflection needs
the mesh's token, RUN_DIR/auth_token (the launchers create it, 0600)."""

from __future__ import annotations

from pathlib import Path

import grpc


def token_metadata(run_dir: str | Path) -> tuple[tuple[str, str], ...]:
    """The `authorization` metadata a call to the mesh in run_dir must carry."""
    token = (Path(run_dir) / "auth_token").read_text().strip()
    return (("authorization", f"Bearer {token}"),)


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata):
        self.metadata = tuple(metadata)

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def mesh_channel(address: str, run_dir: str | Path) -> grpc.Channel:
    """A plaintext (loopback) sync channel whose every call carries the mesh's token."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _WithMetadata(token_metadata(run_dir)))
