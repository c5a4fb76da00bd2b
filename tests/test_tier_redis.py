"""The Redis tier against real redis-server processes: one server, one with AUTH, and a
three-node Redis Cluster, all through the conformance suite; then TTL and a server that dies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.servers import RedisClusterServers, RedisServer
from tiering.errors import TierError, TierTimeout, TierUnavailable
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE, MakeTier, TierConformance, key, payload
from tiering.tier import Tier
from tiers.baselines import tier_rates
from tiers.redis import RedisTier

pytestmark = pytest.mark.redis


def flush(port: int, password: str | None = None) -> None:
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    client.flushall()
    client.close()


class RedisHooks(TierConformance):
    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        assert isinstance(tier, RedisTier)
        await tier.raw_set(key, blob)

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        assert isinstance(tier, RedisTier)
        return await tier.raw_get(key)


class TestRedisTier(RedisHooks):
    @pytest.fixture
    def make_tier(self, redis_server: RedisServer) -> MakeTier:
        flush(redis_server.port)

        def make(**options: Any) -> Tier:
            return RedisTier(namespace=NAMESPACE, url=redis_server.url, **options)

        return make


class TestRedisTierThroughRedisPy(RedisHooks):
    """The path TLS servers take: blocks through redis-py instead of `tiers.resp`."""

    @pytest.fixture
    def make_tier(self, redis_server: RedisServer) -> MakeTier:
        flush(redis_server.port)

        def make(**options: Any) -> Tier:
            return RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=False, **options)

        return make


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password="s3cret")
    server.start()
    yield server
    server.stop()


class TestRedisTierWithAuth(RedisHooks):
    @pytest.fixture
    def make_tier(self, auth_server: RedisServer) -> MakeTier:
        flush(auth_server.port, "s3cret")

        def make(**options: Any) -> Tier:
            return RedisTier(namespace=NAMESPACE, url=auth_server.url, password="s3cret", **options)

        return make


class TestRedisClusterTier(RedisHooks):
    @pytest.fixture
    def make_tier(self, redis_cluster: RedisClusterServers) -> MakeTier:
        for node in redis_cluster.nodes:
            flush(node.port)

        def make(**options: Any) -> Tier:
            return RedisTier(namespace=NAMESPACE, url=redis_cluster.url, cluster=True, **options)

        return make


def test_wrong_password_is_refused(auth_server: RedisServer) -> None:
    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=auth_server.url, password="wrong") as tier:
            with pytest.raises(TierError, match="(?i)password|auth"):
                await tier.put(key(1), b"x")

    asyncio.run(body())


def test_ttl_expires_blocks(redis_server: RedisServer) -> None:
    flush(redis_server.port)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url, ttl="1s") as tier:
            await tier.put(key(1), b"short-lived")
            assert await tier.contains([key(1)]) == [True]
            await asyncio.sleep(2.2)
            assert await tier.contains([key(1)]) == [False]

    asyncio.run(body())


def test_keys_are_prefixed_by_namespace(redis_server: RedisServer) -> None:
    flush(redis_server.port)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url) as tier:
            await tier.put(key(1), b"v")
        client = redis.Redis(host="127.0.0.1", port=redis_server.port)
        assert client.keys() == [f"kvtier:{NAMESPACE.hex()}:{key(1).hex()}".encode()]
        client.close()

    asyncio.run(body())


def test_server_killed_mid_run_then_back(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Calls fail fast as TierUnavailable while the server is down (no hang), the same tier
    object works again once it is back, and what a durable server acknowledged is still there."""
    server = RedisServer(tmp_path_factory.mktemp("redis-dies"), durable=True)
    server.start()

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=server.url, timeout=3.0) as tier:
            await tier.put(key(1), payload(100_000, 1))
            server.stop()
            for call in (
                tier.get(key(1), bytearray(100_000)),
                tier.put(key(2), b"x"),
                tier.contains([key(1), key(2)]),
            ):
                start = time.monotonic()
                with pytest.raises((TierUnavailable, TierTimeout)):
                    await call
                assert time.monotonic() - start < 3.5
            results = await tier.put_many([(key(3), b"y")])
            assert isinstance(results[0], TierUnavailable | TierTimeout)
            server.start()  # same port, same append-only file
            assert await tier.get_bytes(key(1), 100_000) == payload(100_000, 1)
            await tier.put(key(4), payload(1000, 4))
            assert await tier.get_bytes(key(4), 1000) == payload(1000, 4)
            assert tier.counters["errors"] >= 4

    try:
        asyncio.run(body())
    finally:
        server.stop()


def test_a_value_the_server_refuses_fails_alone_and_the_pipeline_stays_in_step(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory mid-pipeline: the refused SETs fail one by one, the stored ones are
    readable on the same connections afterwards (no reply is read out of order)."""
    import tiers.redis

    # The whole batch in one pipeline, as this test is about: split over several connections,
    # the values waiting in their query buffers count as used memory too, and the server may
    # refuse every SET before running any (it did, in one CI run).
    monkeypatch.setattr(tiers.redis, "PIPELINE_BYTES", 64 << 20)
    flush(redis_server.port)
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    used = int(admin.info("memory")["used_memory"])
    size = 256 << 10
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + 3 * size)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url, concurrency=1) as tier:
            blocks = [(key(i), payload(size, i)) for i in range(8)]
            outcomes = await tier.put_many(blocks)
            stored = [i for i, outcome in enumerate(outcomes) if outcome is None]
            refused = [o for o in outcomes if o is not None]
            assert stored and refused, outcomes
            assert all(isinstance(o, TierError) and "OOM" in str(o) for o in refused)
            buffers = [bytearray(size) for _ in stored]
            found = await tier.get_many([(key(i), b) for i, b in zip(stored, buffers, strict=True)])
            assert found == [True] * len(stored)
            assert all(bytes(b) == payload(size, i) for i, b in zip(stored, buffers, strict=True))

    try:
        asyncio.run(body())
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()


def test_connections_the_server_closed_are_replaced(redis_server: RedisServer) -> None:
    flush(redis_server.port)
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url, concurrency=2) as tier:
            await tier.put_many([(key(i), payload(1024, i)) for i in range(4)])
            admin.client_kill_filter(_type="normal", skipme=True)  # the idle pool, server side
            await asyncio.sleep(0.05)
            # A reused connection the server closed is replaced once, silently (GET and SET
            # are idempotent): no miss, no error.
            assert await tier.get(key(1), bytearray(1024)) is True
            assert await tier.get_many([(key(2), bytearray(1024))]) == [True]
            assert tier.counters["errors"] == 0

    try:
        asyncio.run(body())
    finally:
        admin.close()


def test_a_connection_keeps_its_reader_between_exchanges_until_the_server_closes_it(
    redis_server: RedisServer,
) -> None:
    """Registering a socket with the loop costs two system calls: a connection registers once,
    not once per exchange; an idle one the server closes is unregistered (it must not spin)."""
    flush(redis_server.port)
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        registered: list[int] = []
        add_reader = loop.add_reader

        def counted(fd: int, *args: Any) -> None:
            registered.append(fd)
            add_reader(fd, *args)

        loop.add_reader = counted  # type: ignore[method-assign]
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url, concurrency=8) as tier:
            await tier_rates(tier, 256 << 10, 200, 8)  # 8 calls in flight, slots as buffers
            assert len(registered) == len(set(registered)) <= 16  # once per connection
            admin.client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.1)
            selector = loop._selector  # type: ignore[attr-defined]
            assert not set(registered) & set(selector.get_map())
            assert await tier.get_bytes(key(3), 256 << 10) == payload(256 << 10, 3)

    try:
        asyncio.run(body())
    finally:
        admin.close()


def test_a_batch_of_large_blocks_goes_as_several_pipelines_at_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `PIPELINE_BYTES` of values a batch is split into pipelines sent on as many
    connections at once (one connection carries its replies one after another), each value
    still landing in its own buffer."""
    import tiers.redis

    flush(redis_server.port)
    monkeypatch.setattr(tiers.redis, "PIPELINE_BYTES", 100_000)  # about one 64 KiB block each
    size = 64 << 10

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url, concurrency=4) as tier:
            fast = tier._fast
            assert fast is not None
            assert await tier.put_many([(key(i), payload(size, i)) for i in range(8)]) == [None] * 8
            assert len(fast._idle) > 1  # several connections were in use at once
            buffers = [bytearray(size) for _ in range(8)]
            found = await tier.get_many([(key(i), b) for i, b in enumerate(buffers)])
            assert found == [True] * 8
            assert all(bytes(b) == payload(size, i) for i, b in enumerate(buffers))
            assert tier.counters["puts"] == 8 and tier.counters["hits"] == 8

    asyncio.run(body())
