"""Bearer-token auth and TLS / mTLS on a real loopback server; health stays open for probes."""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.core.client import ChannelOptions, open_channel
from rlfabric.core.config import TlsConfig
from rlfabric.core.server import ServerOptions
from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from tests.pki import TestCA

from .probe_services import probe_service

REQUEST = reward_pb2.RewardServiceScoreRequest(items=[reward_pb2.ScoreItem(data_source="ok")])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server cert (SAN 127.0.0.1/localhost), a client cert, and a rogue client cert."""
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA()
    (d / "ca.pem").write_bytes(ca.pem)
    files = {"ca": str(d / "ca.pem")}
    for name, issuer in (("server", ca), ("client", ca), ("rogue", TestCA("rogue"))):
        cert, key = issuer.issue(["localhost", "127.0.0.1"], subject=name)
        (d / f"{name}.pem").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        files[name], files[f"{name}_key"] = str(d / f"{name}.pem"), str(d / f"{name}.key")
    return files


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status


def test_bearer_token_required_except_for_health(serve_in_thread):
    server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=None, auth_token="s3cret"))
    with grpc.insecure_channel(server.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Score(REQUEST, timeout=5)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing" in missing.value.details()
        with pytest.raises(grpc.RpcError) as wrong:
            stub.Score(REQUEST, timeout=5, metadata=[("authorization", "Bearer nope")])
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid" in wrong.value.details()
        assert stub.Score(REQUEST, timeout=5, metadata=[("authorization", "Bearer s3cret")]).results[0].score == 1.0
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_typed_clients_see_auth_failures_as_unauthenticated(serve_in_thread):
    """A typed client with no or a wrong token gets errors.Unauthenticated (code UNAUTHENTICATED), not
    an error that reads as INTERNAL (every status code: tests/core/test_client_errors.py)."""
    import asyncio

    from rlfabric.core import errors
    from rlfabric.reward import ScoreItem
    from rlfabric.reward.client import RewardClient

    server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=None, auth_token="s3cret"))

    async def score_with(token: str | None):
        async with RewardClient(server.address, ChannelOptions(auth_token=token or "", timeout_s=5)) as client:
            return await client.score([ScoreItem("openai/gsm8k", "1", "1")])

    for token in (None, "nope"):
        with pytest.raises(errors.Unauthenticated, match="UNAUTHENTICATED") as refused:
            asyncio.run(score_with(token))
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert [r.score for r in asyncio.run(score_with("s3cret"))] == [1.0]


def test_mtls_refuses_clients_without_a_trusted_cert(serve_in_thread, pki):
    tls = TlsConfig(cert_file=pki["server"], key_file=pki["server_key"], ca_file=pki["ca"], require_client_cert=True)
    server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=None, tls=tls, health_port=0))

    async def score_with(client_tls: TlsConfig):
        async with open_channel(server.address, ChannelOptions(tls=client_tls)) as channel:
            return await reward_pb2_grpc.RewardServiceStub(channel).Score(REQUEST, timeout=5)

    good = TlsConfig(cert_file=pki["client"], key_file=pki["client_key"], ca_file=pki["ca"])
    assert server.run(score_with(good)).results[0].score == 1.0
    for bad in (TlsConfig(ca_file=pki["ca"]), TlsConfig(cert_file=pki["rogue"], key_file=pki["rogue_key"],
                                                          ca_file=pki["ca"])):
        with pytest.raises(grpc.RpcError) as refused:
            server.run(score_with(bad))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plaintext clients cannot reach the TLS port, but the health-only port answers probes.
    with grpc.insecure_channel(server.address) as plaintext, pytest.raises(grpc.RpcError):
        reward_pb2_grpc.RewardServiceStub(plaintext).Score(REQUEST, timeout=3)
    with grpc.insecure_channel(f"127.0.0.1:{server.server.health_port}") as probe:
        assert _health(probe) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as only_health:
            reward_pb2_grpc.RewardServiceStub(probe).Score(REQUEST, timeout=3)
        assert only_health.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_renewed_certificate_is_served_without_a_restart(serve_in_thread, tmp_path):
    """cert-manager renews the mounted Secret (each file replaced whole): new connections get the new
    certificate; clients that trust only the old CA are refused from then on."""
    old_ca, new_ca = TestCA("old-ca"), TestCA("new-ca")
    mounted = tmp_path / "tls"
    mounted.mkdir()

    def install(ca: TestCA) -> None:
        cert, key = ca.issue(["localhost", "127.0.0.1"])
        for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca.pem)):
            (mounted / f".{name}.new").write_bytes(data)
            os.replace(mounted / f".{name}.new", mounted / name)

    def trusting(ca: TestCA) -> TlsConfig:
        (tmp_path / f"{id(ca)}.pem").write_bytes(ca.pem)
        return TlsConfig(ca_file=str(tmp_path / f"{id(ca)}.pem"))

    async def score_with(client_tls: TlsConfig):
        async with open_channel(server.address, ChannelOptions(tls=client_tls)) as channel:
            return await reward_pb2_grpc.RewardServiceStub(channel).Score(REQUEST, timeout=5)

    install(old_ca)
    tls = TlsConfig(cert_file=str(mounted / "tls.crt"), key_file=str(mounted / "tls.key"),
                    ca_file=str(mounted / "ca.crt"))
    server = serve_in_thread(probe_service(), ServerOptions(port=0, metrics_port=None, tls=tls, health_port=0))
    assert server.run(score_with(trusting(old_ca))).results[0].score == 1.0
    install(new_ca)
    assert server.run(score_with(trusting(new_ca))).results[0].score == 1.0
    with pytest.raises(grpc.RpcError) as refused:
        server.run(score_with(trusting(old_ca)))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
