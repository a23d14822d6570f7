"""One error path for every client: a failed call raises the rlfabric.core.errors class of its status
code, naming the role, the address and the call; typed methods cover every RPC (the coordinator's too,
used by the CLI). Real gRPC servers on loopback throughout."""

from __future__ import annotations

import asyncio
import inspect
import socket

import grpc
import pytest

from rlfabric import cli
from rlfabric.actor.client import ActorClient
from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.peers import Peers
from rlfabric.core import errors
from rlfabric.core.client import ChannelOptions
from rlfabric.core.server import ServerOptions, ServiceBinding, ServiceDefinition
from rlfabric.critic.client import CriticClient
from rlfabric.env.client import EnvClient
from rlfabric.reference.client import ReferenceClient
from rlfabric.reward.client import RewardClient, ShardedRewardClient
from rlfabric.reward.items import ScoreItem
from rlfabric.rollout.client import RolloutClient
from rlfabric.v1 import (
    actor_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    critic_pb2,
    environment_pb2,
    reference_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
)

from .probe_services import GatedEngine

FAILURE_CODES = [code for code in grpc.StatusCode if code != grpc.StatusCode.OK]
NO_RETRIES = ChannelOptions(retry_max_attempts=1, timeout_s=10)


class AbortingReward(reward_pb2_grpc.RewardServiceServicer):
    """Score aborts with the status code named by items[0].data_source."""

    async def Score(self, request, context):
        name = request.items[0].data_source
        await context.abort(grpc.StatusCode[name], f"scripted {name}")


class AbortingCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """StreamMetrics sends one step, then aborts with FAILURE_CODES[from_step]."""

    async def StreamMetrics(self, request, context):
        code = FAILURE_CODES[request.from_step]
        yield coordinator_pb2.CoordinatorServiceStreamMetricsResponse(step=request.from_step)
        await context.abort(code, f"scripted {code.name}")


class SlowCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """GetRunStatus answers after 30 s."""

    async def GetRunStatus(self, request, context):
        await asyncio.sleep(30)


async def serve_plain(*servicers) -> tuple[grpc.aio.Server, str]:
    """A bare grpc.aio server (no rlfabric interceptors: the statuses are exactly what the servicers set)."""
    server = grpc.aio.server()
    for servicer in servicers:
        if isinstance(servicer, reward_pb2_grpc.RewardServiceServicer):
            reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
        else:
            coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_every_status_code_has_its_own_domain_error_class():
    # A subclass elsewhere (ChecksumMismatch is an InvalidArgument) must not take over its parent's code.
    import rlfabric.weight_sync.buckets  # noqa: F401

    classes = {code: type(errors.error_for_code(code, "x")) for code in FAILURE_CODES}
    assert all(cls.__module__ == errors.__name__ for cls in classes.values()), classes
    assert all(cls.code == code for code, cls in classes.items()), classes
    assert len(set(classes.values())) == len(FAILURE_CODES)
    assert classes[grpc.StatusCode.INVALID_ARGUMENT] is errors.InvalidArgument
    assert classes[grpc.StatusCode.UNAUTHENTICATED] is errors.Unauthenticated
    assert classes[grpc.StatusCode.PERMISSION_DENIED] is errors.PermissionDenied


def test_each_status_code_reaches_the_caller_as_its_domain_error_naming_role_address_and_call():
    async def scenario():
        server, address = await serve_plain(AbortingReward(), AbortingCoordinator())
        unary, streamed = {}, {}
        try:
            async with RewardClient(address, NO_RETRIES) as reward, CoordinatorClient(address, NO_RETRIES) as coord:
                for index, code in enumerate(FAILURE_CODES):
                    try:
                        await reward.score([ScoreItem(code.name, "1", "1")])
                    except errors.RlfabricError as error:
                        unary[code] = error
                    try:
                        async for _ in coord.stream_metrics(from_step=index):
                            pass
                    except errors.RlfabricError as error:
                        streamed[code] = error
        finally:
            await server.stop(0)
        return address, unary, streamed

    address, unary, streamed = asyncio.run(scenario())
    for code in FAILURE_CODES:
        expected = type(errors.error_for_code(code, ""))
        for error, role, method in ((unary.get(code), "reward", "Score"),
                                    (streamed.get(code), "coordinator", "StreamMetrics")):
            assert type(error) is expected, (code, error)
            assert error.code == code
            assert str(error).startswith(f"{code.name}: {role} at {address} ({method}"), str(error)
            assert str(error).endswith(f"scripted {code.name}"), str(error)
    assert "deadline 10 s" in str(unary[grpc.StatusCode.DEADLINE_EXCEEDED])


def test_a_missed_deadline_names_the_deadline_and_a_refused_connection_is_unavailable():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"

    async def scenario():
        server, address = await serve_plain(SlowCoordinator())
        try:
            async with CoordinatorClient(address, NO_RETRIES) as slow, CoordinatorClient(closed, NO_RETRIES) as gone:
                with pytest.raises(errors.DeadlineExceeded) as late:
                    await slow.run_status(timeout_s=0.2)
                with pytest.raises(errors.Unavailable) as refused:
                    await gone.run_status()
        finally:
            await server.stop(0)
        return address, late.value, refused.value

    address, late, refused = asyncio.run(scenario())
    assert str(late).startswith(f"DEADLINE_EXCEEDED: coordinator at {address} (GetRunStatus, deadline 0.2 s): ")
    assert str(refused).startswith(f"UNAVAILABLE: coordinator at {closed} (GetRunStatus): ")


def test_reward_scoring_that_gives_up_names_the_service_and_the_attempts():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"

    async def scenario():
        reward = ShardedRewardClient([RewardClient(closed, NO_RETRIES)])
        peers = Peers(actor=None, rollout=None, reward=reward, reference=None, critic=None)
        try:
            await peers.score([ScoreItem("openai/gsm8k", "1", "1")], retry_window_s=0.0)
        finally:
            await reward.close()

    with pytest.raises(errors.Unavailable) as gave_up:
        asyncio.run(scenario())
    message = str(gave_up.value)
    assert f"UNAVAILABLE: reward at {closed} (Score)" in message and "gave up at attempt 1" in message, message


# -- the coordinator's typed methods, and the CLI over them ---------------------------------------------


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """A run that is whatever the calls make it; records every request."""

    def __init__(self):
        self.requests: list[tuple[str, object]] = []
        self.state = coordinator_pb2.RUN_STATE_UNSPECIFIED

    async def StartRun(self, request, context):
        self.requests.append(("StartRun", list(request.overrides)))
        self.state = coordinator_pb2.RUN_STATE_RUNNING
        return coordinator_pb2.CoordinatorServiceStartRunResponse(run_id="r7", start_step=2)

    async def GetRunStatus(self, request, context):
        return coordinator_pb2.CoordinatorServiceGetRunStatusResponse(run_id="r7", state=self.state, step=3,
                                                                      total_steps=5)

    async def StreamMetrics(self, request, context):
        self.requests.append(("StreamMetrics", request.from_step))
        for step in range(request.from_step, 6):
            yield coordinator_pb2.CoordinatorServiceStreamMetricsResponse(step=step,
                                                                          metrics={"critic/score/mean": step / 10})

    async def PauseRun(self, request, context):
        self.requests.append(("PauseRun", None))
        self.state = coordinator_pb2.RUN_STATE_PAUSED
        return coordinator_pb2.CoordinatorServicePauseRunResponse()

    async def ResumeRun(self, request, context):
        self.requests.append(("ResumeRun", None))
        self.state = coordinator_pb2.RUN_STATE_RUNNING
        return coordinator_pb2.CoordinatorServiceResumeRunResponse()

    async def StopRun(self, request, context):
        self.requests.append(("StopRun", request.skip_checkpoint))
        self.state = coordinator_pb2.RUN_STATE_STOPPED
        return coordinator_pb2.CoordinatorServiceStopRunResponse()

    async def SaveCheckpoint(self, request, context):
        if self.state == coordinator_pb2.RUN_STATE_STOPPED:
            raise errors.FailedPrecondition("no run to checkpoint")
        self.requests.append(("SaveCheckpoint", None))
        return coordinator_pb2.CoordinatorServiceSaveCheckpointResponse(path="/runs/global_step_3", step=3)


@pytest.fixture
def coordinator(serve_in_thread):
    """A ScriptedCoordinator on the real server runtime (interceptors, auth token "s3cret")."""
    servicer = ScriptedCoordinator()
    binding = ServiceBinding(servicer, coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                             "rlfabric.v1.CoordinatorService")
    server = serve_in_thread(ServiceDefinition(role="coordinator", bindings=[binding], engine=GatedEngine()),
                             ServerOptions(port=0, metrics_port=None, auth_token="s3cret"))
    return servicer, server.address


def test_coordinator_client_has_a_typed_method_for_every_run_control_call(coordinator):
    servicer, address = coordinator

    async def scenario():
        async with CoordinatorClient(address, ChannelOptions(auth_token="s3cret", timeout_s=10)) as client:
            started = await client.start_run(["trainer.total_steps=5"])
            steps = [update.step async for update in client.stream_metrics(from_step=4)]
            await client.pause_run()
            paused = (await client.run_status()).state
            await client.resume_run()
            saved = await client.save_checkpoint()
            await client.stop_run(skip_checkpoint=True)
            with pytest.raises(errors.FailedPrecondition, match=f"coordinator at {address} .*no run to checkpoint"):
                await client.save_checkpoint()
            return started, steps, paused, saved, await client.run_status()

    started, steps, paused, saved, final = asyncio.run(scenario())
    assert (started.run_id, started.start_step, steps) == ("r7", 2, [4, 5])
    assert paused == coordinator_pb2.RUN_STATE_PAUSED and final.state == coordinator_pb2.RUN_STATE_STOPPED
    assert (saved.path, saved.step) == ("/runs/global_step_3", 3)
    assert servicer.requests == [("StartRun", ["trainer.total_steps=5"]), ("StreamMetrics", 4), ("PauseRun", None),
                                 ("ResumeRun", None), ("SaveCheckpoint", None), ("StopRun", True)]


def test_a_wrong_token_is_unauthenticated_for_the_client_and_the_cli(coordinator, tmp_path, capsys):
    servicer, address = coordinator

    async def status_with(token: str):
        async with CoordinatorClient(address, ChannelOptions(auth_token=token, timeout_s=10)) as client:
            return await client.run_status()

    for token in ("", "nope"):
        with pytest.raises(errors.Unauthenticated, match=f"^UNAUTHENTICATED: coordinator at {address} "):
            asyncio.run(status_with(token))

    wrong, right = tmp_path / "wrong", tmp_path / "right"
    wrong.write_text("nope\n")
    right.write_text("s3cret\n")
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["stop", "--coordinator", address, "--token-file", str(wrong)])
    assert exit_code.value.code == 1
    assert capsys.readouterr().err.startswith(f"rlfabric stop: UNAUTHENTICATED: coordinator at {address} (StopRun)")
    assert servicer.requests == []
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["stop", "--no-checkpoint", "--coordinator", address, "--token-file", str(right)])
    assert exit_code.value.code == 0
    assert servicer.requests == [("StopRun", True)]
    assert "run r7 RUN_STATE_STOPPED at step 3" in capsys.readouterr().out


# -- every RPC has a typed method ---------------------------------------------------------------------

# PushWeights is the data plane of the grpc weight-sync transport: the actor streams it itself, over a
# connection per lane (rlfabric.weight_sync.grpc_stream.push_weights), never through a client.
DATA_PLANE = {("RolloutService", "PushWeights")}


@pytest.mark.parametrize("client_class, service", [
    (ActorClient, actor_pb2.DESCRIPTOR.services_by_name["ActorService"]),
    (ReferenceClient, reference_pb2.DESCRIPTOR.services_by_name["ReferenceService"]),
    (CriticClient, critic_pb2.DESCRIPTOR.services_by_name["CriticService"]),
    (RolloutClient, rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]),
    (RewardClient, reward_pb2.DESCRIPTOR.services_by_name["RewardService"]),
    (CoordinatorClient, coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]),
    (EnvClient, environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"]),
], ids=lambda value: getattr(value, "name", None) or value.__name__)
def test_every_rpc_has_a_typed_method(client_class, service):
    source = inspect.getsource(client_class)
    untyped = [m.name for m in service.methods
               if f'"{m.name}"' not in source and (service.name, m.name) not in DATA_PLANE]
    assert untyped == [], f"{client_class.__name__} has no method calling {untyped}"
    assert client_class.stub_class.__name__ == f"{service.name}Stub"
