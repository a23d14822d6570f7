"""Fixtures of the reliability tests: real services started once per module (tiny_model is tests/conftest.py's)."""

from __future__ import annotations

import pytest

from rlfabric.core.server import ServerOptions
from tests.conftest import ServerThread
from tests.core.test_security import pki  # noqa: F401  (fixture: a CA, server and client certs, a rogue cert)


@pytest.fixture(scope="module")
def serve_module():
    """Factory like tests/conftest.py's serve_in_thread, but the servers live for the whole module."""
    started: list[ServerThread] = []

    def start(service, options: ServerOptions | None = None) -> ServerThread:
        thread = ServerThread(service, options or ServerOptions(port=0, metrics_port=None))
        started.append(thread)
        return thread

    yield start
    for thread in started:
        thread.stop()
