"""The S3 tier over HTTPS against SeaweedFS's own TLS gateway (`-s3.port.https`), with a CA the
test makes (`kvtier.certs`): blocks go and come back verified by `ca_bundle`, and each way TLS
can be wrong (a CA that signed nothing, an expired certificate, a plaintext server) is refused
at open in one line, never a fall back to plaintext."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.certs import LocalCA
from kvtier.servers import SeaweedS3
from tests.helpers.tls import refused_at_open
from tiering.errors import ConfigError, TlsError
from tiering.testing import NAMESPACE, key, payload
from tiers.s3 import S3Tier


def refused(make: Any, seconds: float = 3.0) -> str:
    return refused_at_open(make, "s3", seconds)


pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return LocalCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def tls_s3(tmp_path_factory: pytest.TempPathFactory, ca: LocalCA) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs-tls"), tls=ca)
    server.start()
    yield server
    server.stop()


def tier(endpoint: str, server: SeaweedS3, **options: Any) -> S3Tier:
    return S3Tier(
        namespace=NAMESPACE,
        bucket=server.bucket,
        prefix=f"tls-{uuid.uuid4().hex[:8]}/",
        endpoint_url=endpoint,
        access_key=server.ACCESS_KEY,
        secret_key=server.SECRET_KEY,
        **options,
    )


@pytest.mark.parametrize("blocks_per_object", [1, 4])
def test_blocks_go_and_come_back_over_https_verified_by_the_ca_bundle(
    tls_s3: SeaweedS3, ca: LocalCA, blocks_per_object: int
) -> None:
    blocks = [(key(i), payload(4096, i)) for i in range(8)]

    async def body() -> None:
        async with tier(
            tls_s3.https_endpoint,
            tls_s3,
            ca_bundle=str(ca.ca_file),
            blocks_per_object=blocks_per_object,
            pack_after=0.05,
        ) as s3:
            assert await s3.put_many(blocks) == [None] * len(blocks)
            got = [bytearray(4096) for _ in blocks]
            assert await s3.get_many([(k, g) for (k, _), g in zip(blocks, got, strict=True)]) == [
                True
            ] * len(blocks)
            assert [bytes(g) for g in got] == [b for _, b in blocks]

    asyncio.run(body())


def test_a_ca_bundle_that_did_not_sign_the_server_certificate_is_refused_at_open(
    tls_s3: SeaweedS3, ca: LocalCA
) -> None:
    message = refused(lambda: tier(tls_s3.https_endpoint, tls_s3, ca_bundle=str(ca.other_ca_file)))
    assert "certificate verify failed" in message


def test_the_systems_cas_refuse_a_private_ca_without_ca_bundle(tls_s3: SeaweedS3) -> None:
    assert "certificate verify failed" in refused(lambda: tier(tls_s3.https_endpoint, tls_s3))


def test_an_expired_server_certificate_is_refused_at_open(
    tmp_path_factory: pytest.TempPathFactory, ca: LocalCA
) -> None:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs-expired"), tls=ca, cert=ca.expired)
    server.start()
    try:
        message = refused(lambda: tier(server.https_endpoint, server, ca_bundle=str(ca.ca_file)))
    finally:
        server.stop()
    assert "certificate has expired" in message


def test_a_plaintext_server_where_https_was_asked_is_refused_at_open(
    tls_s3: SeaweedS3, ca: LocalCA
) -> None:
    plaintext = tls_s3.endpoint.replace("http://", "https://")
    message = refused(lambda: tier(plaintext, tls_s3, ca_bundle=str(ca.ca_file)))
    assert "plaintext" in message


def test_a_ca_bundle_that_cannot_be_read_is_a_config_error_at_open(
    tls_s3: SeaweedS3, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"tier 's3': ca_bundle .*missing\.pem"):
        tier(tls_s3.https_endpoint, tls_s3, ca_bundle=str(tmp_path / "missing.pem"))


def test_a_tls_failure_after_open_is_a_tls_error_not_a_retry_in_plaintext(
    tls_s3: SeaweedS3, ca: LocalCA
) -> None:
    """The server's certificate replaced after open (here: the CA the tier trusts, swapped
    under it): the call fails with `TlsError`."""
    s3 = tier(tls_s3.https_endpoint, tls_s3, ca_bundle=str(ca.ca_file))
    s3._bucket._client._endpoint.http_session._verify = str(ca.other_ca_file)

    async def body() -> None:
        async with s3:
            with pytest.raises(TlsError, match="certificate verify failed"):
                await s3.put(key(1), payload(4096, 1))

    asyncio.run(body())
