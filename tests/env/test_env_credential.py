"""The environment link has a credential of its own (issue 35, item 12): an environment, possibly a third
party's, never receives the mesh's token, which authorises every RPC of every service.

- A recording environment service on loopback (the built-in servicer behind a bare gRPC server that keeps
  every call's metadata) is called by a real rollout replica's agent loop and by the coordinator's
  readiness check: it sees the environment's token, never the mesh's.
- `rlfabric serve env` requires the environment's token and refuses the mesh's.
- The local launcher makes the environment's token (RUN_DIR/env_token), and a config that gives the
  environment the mesh's token is refused.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest

from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import ConfigError, RunConfig, load_config
from rlfabric.core.server import ServerOptions, ServiceBinding, ServiceDefinition
from rlfabric.env.servicer import build_service as build_env_service
from rlfabric.rollout import wire
from rlfabric.rollout.servicer import build_service as build_rollout_service
from rlfabric.rollout.types import AgentPrompt, AgentTask, MultiTurnSpec, SamplingSpec
from rlfabric.v1 import environment_pb2, environment_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.conftest import ServerThread

MESH_TOKEN = "the-mesh-token-that-authorises-everything-0123456789"
ENV_TOKEN = "the-environment-token-for-env-calls-only-9876543210"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    paths = {}
    for name, token in (("auth_token", MESH_TOKEN), ("env_token", ENV_TOKEN)):
        paths[name] = folder / name
        paths[name].write_text(token)
        paths[name].chmod(0o600)
    return paths


class RecordingEnvironment(environment_pb2_grpc.EnvironmentServiceServicer):
    """The built-in environment servicer, keeping the metadata of every call it gets (as any environment,
    a third party's included, can)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, dict[str, str]]] = []

    def _record(self, method: str, context) -> None:
        self.calls.append((method, {key: str(value) for key, value in context.invocation_metadata()}))

    async def Reset(self, request, context):
        self._record("Reset", context)
        return await self.inner.Reset(request, context)

    async def Step(self, request, context):
        self._record("Step", context)
        return await self.inner.Step(request, context)

    async def Close(self, request, context):
        self._record("Close", context)
        return await self.inner.Close(request, context)

    async def GetStatus(self, request, context):
        self._record("GetStatus", context)
        return await self.inner.GetStatus(request, context)


@pytest.fixture(scope="module")
def recording_env():
    service = build_env_service(RunConfig())
    recorder = RecordingEnvironment(service.bindings[0].servicer)
    binding = ServiceBinding(recorder, environment_pb2_grpc.add_EnvironmentServiceServicer_to_server,
                             "rlfabric.v1.EnvironmentService")
    server = ServerThread(ServiceDefinition("env", [binding], service.engine, service.registry),
                          ServerOptions(port=0, metrics_port=None))  # it checks nothing: it only records
    yield server, recorder
    server.stop()


def mesh_config(tiny_model, tokens, env_address: str) -> RunConfig:
    return load_config(None, [f"model.path={tiny_model}", f"server.auth_token_file={tokens['auth_token']}",
                              f"env.auth_token_file={tokens['env_token']}", "rollout.multi_turn.enable=true",
                              f"rollout.multi_turn.env_address={env_address}", "cluster.actor=[127.0.0.1:1]",
                              "cluster.rollout=[127.0.0.1:2]", "cluster.reward=[127.0.0.1:3]"])


def multi_turn_request() -> rollout_pb2.RolloutServiceGenerateRequest:
    prompt = AgentPrompt([{"role": "user", "content": "What is 6*7?"}], AgentTask("calculator", "42"))
    spec = SamplingSpec(n=2, max_tokens=8, temperature=1.0, seed=3,
                        multi_turn=MultiTurnSpec(max_turns=2, max_total_tokens=64, env_timeout_s=10.0))
    return rollout_pb2.RolloutServiceGenerateRequest(prompts=[wire.prompt_to_proto(prompt)],
                                                     sampling_params=wire.sampling_to_proto(spec))


def test_the_environment_never_receives_the_mesh_token(tiny_model, tokens, recording_env):
    from rlfabric.coordinator.peers import Peers

    env, recorder = recording_env
    config = mesh_config(tiny_model, tokens, env.address)
    rollout = ServerThread(build_rollout_service(config), ServerOptions.from_config(config.server, port=0,
                                                                                   metrics_port=None))
    try:
        with grpc.insecure_channel(rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            samples = stub.Generate(multi_turn_request(), timeout=60,
                                    metadata=(("authorization", f"Bearer {MESH_TOKEN}"),)).samples
        assert len(samples) == 2
    finally:
        rollout.stop()

    async def coordinator_checks_the_environment():  # the coordinator's readiness wait includes the env
        peers = Peers.connect(config)
        try:
            return await peers.env.status()
        finally:
            await peers.close()

    assert asyncio.run(coordinator_checks_the_environment()).environments
    methods = [method for method, _ in recorder.calls]
    assert {"Reset", "GetStatus"} <= set(methods), methods
    for method, metadata in recorder.calls:
        assert not any(MESH_TOKEN in f"{key}: {value}" for key, value in metadata.items()), (method, metadata)
        assert metadata.get("authorization") == f"Bearer {ENV_TOKEN}", (method, metadata)


def test_the_env_service_requires_the_environment_token_not_the_mesh_token(tokens, tmp_path):
    """As the chart's env pod runs it: the config names the mesh's token file, which is not there."""
    port_file = tmp_path / "ports.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "env", "--port", "0", "--metrics-port", "0",
         "--port-file", str(port_file), f"server.auth_token_file={tmp_path / 'not-mounted' / 'token'}",
         f"env.auth_token_file={tokens['env_token']}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert server.poll() is None and time.monotonic() < deadline, "the env service did not start"
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}") as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            request = environment_pb2.EnvironmentServiceGetStatusRequest()
            assert stub.GetStatus(request, timeout=60, wait_for_ready=True,
                                  metadata=(("authorization", f"Bearer {ENV_TOKEN}"),)).environments
            for metadata in ((("authorization", f"Bearer {MESH_TOKEN}"),), ()):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.GetStatus(request, timeout=10, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.terminate()
        server.wait(30)


def test_the_launcher_makes_the_environment_a_token_of_its_own(tiny_model, tmp_path):
    from rlfabric.launch.local import prepare_run_dir

    config = load_config(None, [f"model.path={tiny_model}", "env.enable=true", "rollout.multi_turn.enable=true"])
    prepare_run_dir(config, tmp_path / "run")
    mesh, env = tmp_path / "run" / "auth_token", tmp_path / "run" / "env_token"
    assert config.env.auth_token_file == str(env.resolve())
    assert env.stat().st_mode & 0o777 == 0o600
    assert env.read_text() and env.read_text() != mesh.read_text()
    assert ChannelOptions.for_env(config).auth_token == env.read_text()


def test_giving_the_environment_the_mesh_token_is_refused(tokens):
    config = load_config(None, [f"server.auth_token_file={tokens['auth_token']}",
                                f"env.auth_token_file={tokens['auth_token']}"])
    with pytest.raises(ConfigError, match="env.auth_token_file holds the mesh's token"):
        ChannelOptions.for_env(config)
