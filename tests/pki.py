"""Test certificates: a throwaway CA that issues certificates for given DNS names and IP addresses
(for TLS tests, and for the chart's acceptance test, where it stands in for cert-manager)."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def certificate(subject: str, key, issuer_key, issuer_name: x509.Name | None = None, is_ca: bool = False,
                names: list[str] = ()) -> x509.Certificate:
    """A certificate for `key` signed by `issuer_key` (self-signed when issuer_name is None); `names`
    become its subject alternative names (IP addresses as IP entries)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    subject_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject_name)
        .issuer_name(issuer_name or subject_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


class TestCA:
    """A CA that issues leaf certificates: `cert, key = ca.issue(["svc.ns.svc"])`, `ca.pem`."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = "rlfabric-test-ca"):
        self.key = new_key()
        self.cert = certificate(name, self.key, self.key, is_ca=True)
        self.pem = cert_pem(self.cert)

    def issue(self, names: list[str], subject: str = "") -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for the given DNS names / IP addresses."""
        key = new_key()
        cert = certificate(subject or names[0], key, self.key, self.cert.subject, names=names)
        return cert_pem(cert), key_pem(key)
