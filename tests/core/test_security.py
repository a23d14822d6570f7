"""Bearer-token auth and TLS / mTLS on a real loopback server; health stays open for probes."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.core.client import ChannelOptions, open_channel
from rlfabric.core.config import TlsConfig
from rlfabric.core.server import ServerOptions
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

from .probe_services import probe_service

REQUEST = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(data_source="ok")])


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_key, issuer_name, is_ca: bool, san: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if san:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> str:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server cert (SAN 127.0.0.1/localhost), a client cert, and a rogue client cert."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlfabric-test-ca")])
    ca = _cert("rlfabric-test-ca", ca_key, ca_key, ca_name, is_ca=True, san=False)
    files = {"ca": _write(d / "ca.pem", cert=ca)}
    for name, issuer_key, issuer_name in (("server", ca_key, ca_name), ("client", ca_key, ca_name)):
        key = _key()
        files[name] = _write(d / f"{name}.pem", cert=_cert(name, key, issuer_key, issuer_name, False, True))
        files[f"{name}_key"] = _write(d / f"{name}.key", key=key)
    rogue_key = _key()
    rogue_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rogue")])
    files["rogue"] = _write(d / "rogue.pem", cert=_cert("rogue", rogue_key, rogue_key, rogue_name, False, True))
    files["rogue_key"] = _write(d / "rogue.key", key=rogue_key)
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
