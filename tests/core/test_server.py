"""The shared server runtime on a real loopback gRPC server: health, reflection, metrics,
error mapping, message limits, streaming through the interceptors, readiness gating."""

from __future__ import annotations

import os
import subprocess
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfabric.core import codec
from rlfabric.core.server import ServerOptions
from rlfabric.v1 import (
    actor_pb2,
    actor_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    tensor_pb2,
)

from .probe_services import GatedEngine, probe_service

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def score(channel, source: str, timeout: float = 10):
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    request = reward_pb2.RewardServiceScoreRequest(items=[reward_pb2.ScoreItem(data_source=source)])
    return stub.Score(request, timeout=timeout)


def health(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture
def probe(serve_in_thread):
    server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=0, max_receive_bytes=1 << 20))
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        yield server, channel


def test_health_reports_liveness_readiness_and_services(probe):
    _, channel = probe
    for name in ("liveness", "readiness", "", "rlfabric.v1.RewardService"):
        assert health(channel, name) == SERVING


def test_reflection_lists_every_service(probe):
    _, channel = probe
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"rlfabric.v1.RewardService", "rlfabric.v1.ActorService", "grpc.health.v1.Health"} <= names


def test_domain_error_maps_to_status_and_server_keeps_serving(probe):
    _, channel = probe
    with pytest.raises(grpc.RpcError) as info:
        score(channel, "invalid")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ground_truth is required" in info.value.details()
    assert score(channel, "ok").results[0].score == 1.0


def test_unexpected_exception_is_internal_and_server_keeps_serving(probe):
    _, channel = probe
    with pytest.raises(grpc.RpcError) as info:
        score(channel, "crash")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: scorer blew up" in info.value.details()
    assert score(channel, "ok").results[0].score == 1.0


def test_a_full_disk_is_resource_exhausted_saying_so(probe, tmp_path):
    """A handler's write fails with ENOSPC on a real full disk (a 64 KiB tmpfs): not INTERNAL, but
    RESOURCE_EXHAUSTED saying the disk is full; the server keeps serving."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (run as root to test a full disk)")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        _, channel = probe
        with pytest.raises(grpc.RpcError) as info:
            score(channel, f"write:{small / 'big'}")
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "the disk is full" in info.value.details() and "No space left on device" in info.value.details()
    assert score(channel, "ok").results[0].score == 1.0


def test_unimplemented_rpc_answers_unimplemented(probe):
    _, channel = probe
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetStatus(reward_pb2.RewardServiceGetStatusRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _compute_log_probs(channel, batch: tensor_pb2.Batch):
    stub = actor_pb2_grpc.ActorServiceStub(channel)
    request = actor_pb2.ActorServiceComputeLogProbsRequest(input=common_pb2.LogProbsInput(batch=batch))
    return stub.ComputeLogProbs(request, timeout=10)


def test_malformed_tensor_is_invalid_argument(probe):
    _, channel = probe
    batch = codec.encode_batch({"input_ids": torch.zeros(2, 3, dtype=torch.int64)})
    batch.tensors["input_ids"].raw_data = batch.tensors["input_ids"].raw_data[:-1]
    with pytest.raises(grpc.RpcError) as info:
        _compute_log_probs(channel, batch)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_data has 47 bytes" in info.value.details()
    good = codec.encode_batch({"input_ids": torch.zeros(2, 3, dtype=torch.int64)})
    assert codec.to_torch(_compute_log_probs(channel, good).outputs.tensors["rows"]).shape == (2,)


def test_unknown_enum_value_is_invalid_argument(probe):
    _, channel = probe
    batch = codec.encode_batch({"input_ids": torch.zeros(2, 3, dtype=torch.int64)})
    batch.tensors["input_ids"].dtype = 99  # open enum: the wire carries unknown values through
    with pytest.raises(grpc.RpcError) as info:
        _compute_log_probs(channel, batch)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown or unspecified tensor dtype 99" in info.value.details()


def test_oversized_message_is_resource_exhausted(probe):
    _, channel = probe
    batch = codec.encode_batch({"input_ids": torch.zeros(1, 300_000, dtype=torch.int64)})  # 2.4 MB > 1 MiB
    with pytest.raises(grpc.RpcError) as info:
        _compute_log_probs(channel, batch)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert score(channel, "ok").results[0].score == 1.0


def _unknown_field(num_bytes: int) -> bytes:
    """A valid serialized message of any type: field 15 (unknown to it), num_bytes long."""
    from google.protobuf.internal.encoder import _VarintBytes

    return bytes([15 << 3 | 2]) + _VarintBytes(num_bytes) + bytes(num_bytes)


def test_a_method_without_bulk_data_refuses_a_large_request_unparsed(serve_in_thread):
    """Bulk methods (batches, prompts, weights) take up to max_receive_bytes; the others (here
    StreamMetrics) up to max_control_receive_bytes, refused by length before protobuf parses."""
    options = ServerOptions(port=0, metrics_port=None, max_receive_bytes=8 << 20, max_control_receive_bytes=64 << 10)
    server = serve_in_thread(probe_service(), options)
    with grpc.insecure_channel(server.address) as channel:
        stream = channel.unary_stream("/rlfabric.v1.CoordinatorService/StreamMetrics")
        with pytest.raises(grpc.RpcError) as info:
            list(stream(_unknown_field(100 << 10), timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than this method's limit of 65536 bytes" in info.value.details()
        assert "server.max_control_message_kb" in info.value.details()
        assert len(list(stream(_unknown_field(1 << 10), timeout=10))) == 3
        score = channel.unary_unary("/rlfabric.v1.RewardService/Score")  # a bulk method: 1 MiB is fine
        assert reward_pb2.RewardServiceScoreResponse.FromString(score(_unknown_field(1 << 20), timeout=10))


def test_a_role_without_bulk_methods_has_grpc_refuse_a_large_request_unread(serve_in_thread):
    from rlfabric.core.server import ServiceBinding, ServiceDefinition

    from .probe_services import ProbeCoordinator

    binding = ServiceBinding(ProbeCoordinator(), coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
                             "rlfabric.v1.CoordinatorService")
    options = ServerOptions(port=0, metrics_port=None, max_receive_bytes=8 << 20, max_control_receive_bytes=64 << 10)
    assert options.message_limits.of_server(["rlfabric.v1.CoordinatorService"]) == 64 << 10
    assert options.message_limits.of_server(["rlfabric.v1.RewardService"]) == 8 << 20
    server = serve_in_thread(ServiceDefinition("coordinator", [binding], GatedEngine()), options)
    with grpc.insecure_channel(server.address) as channel:
        stream = channel.unary_stream("/rlfabric.v1.CoordinatorService/StreamMetrics")
        with pytest.raises(grpc.RpcError) as info:
            list(stream(_unknown_field(100 << 10), timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()  # gRPC's own refusal, from the length prefix


def test_streaming_rpcs_pass_through_interceptors(probe):
    _, channel = probe
    metrics = coordinator_pb2_grpc.CoordinatorServiceStub(channel).StreamMetrics(
        coordinator_pb2.CoordinatorServiceStreamMetricsRequest(from_step=5), timeout=5
    )
    assert [m.step for m in metrics] == [5, 6, 7]
    chunks = [rollout_pb2.RolloutServicePushWeightsRequest(data=b"x" * 1000) for _ in range(4)]
    pushed = rollout_pb2_grpc.RolloutServiceStub(channel).PushWeights(iter(chunks), timeout=5)
    assert pushed.version == 4000


def test_metrics_endpoint_has_go_grpc_prometheus_series(probe):
    server, channel = probe
    score(channel, "ok")
    with pytest.raises(grpc.RpcError):
        score(channel, "invalid")
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
    list(stub.StreamMetrics(coordinator_pb2.CoordinatorServiceStreamMetricsRequest()))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=5).read().decode()
    labels = 'grpc_method="Score",grpc_service="rlfabric.v1.RewardService",grpc_type="unary"'
    assert f"grpc_server_started_total{{{labels}}} 2.0" in text
    assert f'grpc_server_handled_total{{grpc_code="OK",{labels}}} 1.0' in text
    assert f'grpc_server_handled_total{{grpc_code="INVALID_ARGUMENT",{labels}}} 1.0' in text
    assert f"grpc_server_handling_seconds_count{{{labels}}} 2.0" in text
    assert 'grpc_code="OK",grpc_method="StreamMetrics",grpc_service="rlfabric.v1.CoordinatorService",' \
           'grpc_type="server_stream"} 1.0' in text


def test_readiness_gates_rpcs_until_engine_is_loaded(serve_in_thread):
    engine = GatedEngine(open_at_start=False)
    server = serve_in_thread(probe_service(engine), ServerOptions(port=0, metrics_port=None), wait_ready=False)
    with grpc.insecure_channel(server.address) as channel:
        assert health(channel, "liveness") == SERVING
        assert health(channel, "readiness") == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            score(channel, "ok")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine is still loading" in info.value.details()
        server.loop.call_soon_threadsafe(engine.gate.set)
        server._start.result(timeout=10)
        assert health(channel, "readiness") == SERVING
        assert score(channel, "ok").results[0].score == 1.0


def test_single_attempt_channels_have_a_valid_service_config(serve_in_thread):
    import asyncio
    import json as _json

    from rlfabric.core.client import ChannelOptions, open_channel

    options = ChannelOptions(retry_max_attempts=1)
    assert "retryPolicy" not in _json.loads(options.service_config())["methodConfig"][0]
    server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=None))

    async def call():
        async with open_channel(server.address, options) as channel:
            request = reward_pb2.RewardServiceScoreRequest(items=[reward_pb2.ScoreItem(data_source="ok")])
            return await reward_pb2_grpc.RewardServiceStub(channel).Score(request, timeout=5)

    assert asyncio.run(call()).results[0].score == 1.0
