"""A throwaway certificate authority for TLS tests and benchmarks (any thread: files).

`LocalCA(directory)` writes a CA and, signed by it, a server certificate for 127.0.0.1 and
`localhost`, a client certificate and an expired server certificate; `other` is a second CA
that signed none of them (a wrong CA for a client to trust). Keys are EC P-256: made in
milliseconds. Needs the `cryptography` package (the `test` extra), imported here only.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CertPair", "LocalCA"]


@dataclass(frozen=True, slots=True)
class CertPair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class LocalCA:
    """Test or benchmark process, any thread: a CA and the certificates it signed, as PEM
    files under `directory`."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        now = datetime.datetime.now(datetime.UTC)
        self._ca_key, self._ca_cert = _authority("kvtier test CA", now)
        self.ca_file = self._write_cert("ca.pem", self._ca_cert)
        """The CA's certificate: what a client trusts."""
        self.server = self._issue("server", now - _DAY, now + 30 * _DAY, server=True)
        self.client = self._issue("client", now - _DAY, now + 30 * _DAY, server=False)
        self.expired = self._issue("expired", now - 30 * _DAY, now - _DAY, server=True)
        """A server certificate whose validity ended yesterday."""
        _, other = _authority("kvtier other CA", now)
        self.other_ca_file = self._write_cert("other-ca.pem", other)
        """A CA that signed none of these certificates."""

    def _issue(
        self, name: str, start: datetime.datetime, end: datetime.datetime, *, server: bool
    ) -> CertPair:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvtier {name}")]))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        )
        cert = builder.sign(self._ca_key, hashes.SHA256())
        return CertPair(self._write_cert(f"{name}.pem", cert), self._write_key(f"{name}.key", key))

    def _write_cert(self, name: str, cert: Any) -> Path:
        from cryptography.hazmat.primitives.serialization import Encoding

        path = self.directory / name
        path.write_bytes(cert.public_bytes(Encoding.PEM))
        return path

    def _write_key(self, name: str, key: Any) -> Path:
        from cryptography.hazmat.primitives import serialization

        path = self.directory / name
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)
        return path


_DAY = datetime.timedelta(days=1)


def _authority(name: str, now: datetime.datetime) -> tuple[Any, Any]:
    """A self-signed CA: its key and certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + 365 * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert
