"""The Redis tier over TLS against real redis-server processes speaking only TLS, with a CA the
test makes (`kvtier.certs`): the conformance suite with a client certificate, and each way TLS
can be wrong (a CA that signed nothing, an expired certificate, a plaintext server, no client
certificate) refused at open in one line, never a fall back to plaintext."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.certs import LocalCA
from kvtier.cli import main
from kvtier.servers import RedisServer
from tests.helpers.tls import refused_at_open
from tests.tiers.redis_hooks import RedisHooks, flush
from tiering.errors import ConfigError, TierUnavailable, TlsError
from tiering.testing import NAMESPACE, key
from tiering.testing.tier import MakeTier
from tiering.tier import Tier
from tiers.redis import RedisTier


def refused(make: Any, seconds: float = 3.0) -> str:
    return refused_at_open(make, "redis", seconds)


pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return LocalCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, ca: LocalCA) -> Iterator[RedisServer]:
    """TLS only, and only for clients that present a certificate the CA signed."""
    server = RedisServer(tmp_path_factory.mktemp("redis-tls"), tls=ca, client_auth=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expired_server(tmp_path_factory: pytest.TempPathFactory, ca: LocalCA) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-expired"), tls=ca, cert=ca.expired)
    server.start()
    yield server
    server.stop()


def tls_options(ca: LocalCA) -> dict[str, Any]:
    return {
        "tls_ca_file": str(ca.ca_file),
        "tls_cert_file": str(ca.client.cert),
        "tls_key_file": str(ca.client.key),
    }


class TestRedisTierOverTls(RedisHooks):
    @pytest.fixture
    def make_tier(self, tls_server: RedisServer, ca: LocalCA) -> Iterator[MakeTier]:
        raw = redis.Redis(host="127.0.0.1", port=tls_server.port, **tls_server.ssl())
        raw.flushall()

        def make(**options: Any) -> Tier:
            return RedisTier(
                url=tls_server.url, **{"namespace": NAMESPACE, **tls_options(ca), **options}
            )

        with self.connected(tls_server):
            self.raw.close()
            self.raw = raw
            yield make


def test_tls_options_on_a_redis_url_speak_tls_and_say_once_the_fast_path_steps_aside(
    tls_server: RedisServer, ca: LocalCA, caplog: pytest.LogCaptureFixture
) -> None:
    url = tls_server.url.replace("rediss://", "redis://")
    redis.Redis(host="127.0.0.1", port=tls_server.port, **tls_server.ssl()).flushall()

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=url, **tls_options(ca)) as tier:
            for i in range(3):
                await tier.put(key(i), b"x" * 1000)
            for i in range(3):
                assert await tier.get_bytes(key(i), 1000) == b"x" * 1000

    with caplog.at_level(logging.INFO, "tiers.redis"):
        asyncio.run(body())
    said = [r for r in caplog.records if "fast path" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "redis-py" in said[0].getMessage()


def test_a_ca_that_did_not_sign_the_server_certificate_is_refused_at_open(
    tls_server: RedisServer, ca: LocalCA
) -> None:
    options = tls_options(ca) | {"tls_ca_file": str(ca.other_ca_file)}
    message = refused(lambda: RedisTier(namespace=NAMESPACE, url=tls_server.url, **options))
    assert "certificate verify failed" in message


def test_an_expired_server_certificate_is_refused_at_open(
    expired_server: RedisServer, ca: LocalCA
) -> None:
    message = refused(
        lambda: RedisTier(namespace=NAMESPACE, url=expired_server.url, tls_ca_file=str(ca.ca_file))
    )
    assert "certificate has expired" in message


def test_a_plaintext_server_where_tls_was_asked_is_refused_within_the_connect_timeout(
    redis_server: RedisServer, ca: LocalCA
) -> None:
    message = refused(
        lambda: RedisTier(
            namespace=NAMESPACE, url=redis_server.url, connect_timeout=0.5, **tls_options(ca)
        )
    )
    assert "plaintext" in message
    flush(redis_server.port)  # nothing reached it as a command


def test_a_server_that_wants_a_client_certificate_refuses_a_tier_without_one(
    tls_server: RedisServer, ca: LocalCA
) -> None:
    message = refused(
        lambda: RedisTier(namespace=NAMESPACE, url=tls_server.url, tls_ca_file=str(ca.ca_file))
    )
    assert "certificate" in message


def test_a_ca_file_that_cannot_be_read_is_a_config_error_at_open(
    tls_server: RedisServer, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"tier 'redis': tls_ca_file .*missing\.pem"):
        RedisTier(
            namespace=NAMESPACE, url=tls_server.url, tls_ca_file=str(tmp_path / "missing.pem")
        )


def test_a_tls_server_that_is_down_at_open_is_unavailable_not_refused(ca: LocalCA) -> None:
    """Nothing listens: not TLS's fault; the tier's calls report it, as without TLS."""

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url="rediss://127.0.0.1:1/0", **tls_options(ca))
        async with tier:
            with pytest.raises(TierUnavailable) as caught:
                await tier.put(key(1), b"x")
            assert not isinstance(caught.value, TlsError)

    asyncio.run(body())


def test_kvtier_stats_exits_2_with_the_one_line_tls_error(
    expired_server: RedisServer, ca: LocalCA, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "tiers:\n"
        "  - name: shared\n"
        "    type: redis\n"
        f"    url: {expired_server.url}\n"
        f"    tls_ca_file: {ca.ca_file}\n"
    )
    with contextlib.chdir(tmp_path):
        code = main(["stats", "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "tier 'shared'" in lines[0] and "certificate has expired" in lines[0]
