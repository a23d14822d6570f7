"""Tracing (rlfabric.core.tracing) in one process: off, nothing is installed; on, the spans of a
step's phase, of the client calls made in it and of the server handling them (unary, server- and
client-streaming, refused and failed calls) reach a real OTLP receiver linked parent to child."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlfabric.coordinator.step_metrics import StepTimer
from rlfabric.core import tracing
from rlfabric.core.client import open_channel
from rlfabric.core.config import TracingConfig
from rlfabric.core.interceptors import MetricsInterceptor, bearer_metadata
from rlfabric.core.server import RlfabricServer, ServerOptions
from rlfabric.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from tests.otlp_receiver import OtlpReceiver

from .probe_services import probe_service

SERVER, CLIENT = 2, 3  # OTLP span kinds
TOKEN = "probe-token"


def channel_interceptors(channel) -> list:
    return [*channel._unary_unary_interceptors, *channel._unary_stream_interceptors,
            *channel._stream_unary_interceptors, *channel._stream_stream_interceptors]


def test_with_tracing_off_no_provider_and_no_interceptor_is_installed():
    assert tracing.setup(TracingConfig(), "actor") is False  # the default: endpoint ""
    assert not tracing.active()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors("127.0.0.1:1") == []
    chain = RlfabricServer(probe_service(), ServerOptions())._interceptors()
    assert isinstance(chain[0], MetricsInterceptor)
    assert not any(isinstance(i, tracing.ServerTracingInterceptor) for i in chain)

    async def channel_without_interceptors():
        async with open_channel("127.0.0.1:1") as channel:
            return channel_interceptors(channel)

    assert asyncio.run(channel_without_interceptors()) == []
    timer = StepTimer(3)
    with timer("gen"):
        tracing.annotate(samples=4)
    assert timer.trace.span is None and "gen" in timer.seconds


@pytest.fixture
def traced(serve_in_thread):
    """Tracing on in this process (service test-probe), a probe server that needs a token, the receiver."""
    with OtlpReceiver() as receiver:
        assert tracing.setup(TracingConfig(endpoint=receiver.endpoint, service_name_prefix="test-"), "probe")
        try:
            server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=None, auth_token=TOKEN))
            yield server, receiver
        finally:
            tracing.shutdown()


async def calls_in_a_phase(address: str) -> None:
    timer = StepTimer(7)
    metadata = bearer_metadata(TOKEN)
    async with open_channel(address) as channel:
        assert len(channel_interceptors(channel)) == 4  # one per RPC kind
        with timer("gen"):
            await reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.RewardServiceScoreRequest(items=[reward_pb2.ScoreItem(data_source="ok")]), metadata=metadata)
            stream = coordinator_pb2_grpc.CoordinatorServiceStub(channel).StreamMetrics(
                coordinator_pb2.CoordinatorServiceStreamMetricsRequest(from_step=1), metadata=metadata)
            assert [r.step async for r in stream] == [1, 2, 3]
            pushed = await rollout_pb2_grpc.RolloutServiceStub(channel).PushWeights(
                iter([rollout_pb2.RolloutServicePushWeightsRequest(data=b"x" * 5)] * 3), metadata=metadata)
            assert pushed.version == 15
            tracing.annotate(samples=4)
        with timer("update"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await reward_pb2_grpc.RewardServiceStub(channel).Score(
                    reward_pb2.RewardServiceScoreRequest())  # no token
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                invalid_items = [reward_pb2.ScoreItem(data_source="invalid")]
                await reward_pb2_grpc.RewardServiceStub(channel).Score(
                    reward_pb2.RewardServiceScoreRequest(items=invalid_items), metadata=metadata)
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    timer.end()
    StepTimer(8).end(RuntimeError("the actor is gone"))  # a failed step


def test_phase_client_and_server_spans_link_up_for_every_rpc_kind(traced):
    server, receiver = traced
    asyncio.run(calls_in_a_phase(server.address))
    # A client span has ended before its caller has the response (a stream's at the call's end, while
    # the caller's loop went on); a server span once its handler returns, which for an aborted call can
    # be after the status went out: a graceful stop lets every handler return.
    server.stop(grace=10)
    tracing.shutdown()  # exports them
    spans = receiver.spans()
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "train_step" and s.attributes["rlfabric.step"] == 7]
    assert root.attributes["rlfabric.step"] == 7 and root.parent_span_id == "" and root.service == "test-probe"
    (failed,) = [s for s in spans if s.name == "train_step" and s.attributes["rlfabric.step"] == 8]
    assert failed.status_code == 2 and root.status_code == 0  # OTLP: error, unset
    phases = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert set(phases) == {"gen", "update"} and phases["gen"].attributes["rlfabric.samples"] == 4

    def pairs(method: str) -> list[tuple]:
        """(client span, server span) of each call of `method`, the server's parent the client's span."""
        servers = [s for s in spans if s.name == method and s.kind == SERVER]
        for server in servers:
            assert by_id[server.parent_span_id].kind == CLIENT and by_id[server.parent_span_id].name == method
        return [(by_id[s.parent_span_id], s) for s in servers]

    ok = 0
    for method in ("rlfabric.v1.CoordinatorService/StreamMetrics", "rlfabric.v1.RolloutService/PushWeights"):
        ((client, server),) = pairs(method)
        assert client.parent_span_id == phases["gen"].span_id and client.trace_id == root.trace_id
        assert client.attributes["rpc.grpc.status_code"] == server.attributes["rpc.grpc.status_code"] == ok
    scores = pairs("rlfabric.v1.RewardService/Score")
    codes = sorted((client.attributes["rpc.grpc.status_code"], server.status_code, by_id[client.parent_span_id].name)
                   for client, server in scores)
    error = 2  # OTLP status code
    assert codes == [(ok, 0, "gen"), (grpc.StatusCode.INVALID_ARGUMENT.value[0], error, "update"),
                     (grpc.StatusCode.UNAUTHENTICATED.value[0], error, "update")]
