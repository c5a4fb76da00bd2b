"""The Redis tier against real redis-server processes: one server, one with AUTH, and a
three-node Redis Cluster, all through the conformance suite; then TTL and a server that dies."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.baselines import tier_rates
from kvtier.servers import RedisClusterServers, RedisServer
from tests.tiers.redis_hooks import RedisHooks, flush, name, plant, stopped, stored
from tiering.config import parse_config
from tiering.errors import (
    ConfigError,
    CorruptObject,
    TierError,
    TierFull,
    TierTimeout,
    TierUnavailable,
)
from tiering.keys import BlockKey
from tiering.runtime import fault_of
from tiering.testing import NAMESPACE, craft, key, payload
from tiering.testing.tier import MakeTier, StoreDown
from tiering.tier import Tier, TierStat
from tiers.redis import RedisTier

pytestmark = pytest.mark.redis


class TestRedisTier(RedisHooks):
    @pytest.fixture
    def make_tier(self, redis_server: RedisServer) -> Iterator[MakeTier]:
        flush(redis_server.port)

        def make(**options: Any) -> Tier:
            return RedisTier(url=redis_server.url, **{"namespace": NAMESPACE, **options})

        with self.connected(redis_server):
            yield make


class TestRedisTierThroughRedisPy(RedisHooks):
    """The path TLS servers take: blocks through redis-py instead of `tiers.redis.resp`."""

    @pytest.fixture
    def make_tier(self, redis_server: RedisServer) -> Iterator[MakeTier]:
        flush(redis_server.port)

        def make(**options: Any) -> Tier:
            return RedisTier(
                url=redis_server.url, fast_path=False, **{"namespace": NAMESPACE, **options}
            )

        with self.connected(redis_server):
            yield make


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password="s3cret")
    server.start()
    yield server
    server.stop()


class TestRedisTierWithAuth(RedisHooks):
    @pytest.fixture
    def make_tier(self, auth_server: RedisServer) -> Iterator[MakeTier]:
        flush(auth_server.port, "s3cret")

        def make(**options: Any) -> Tier:
            return RedisTier(
                url=auth_server.url, password="s3cret", **{"namespace": NAMESPACE, **options}
            )

        with self.connected(auth_server):
            yield make


class TestRedisClusterTier(RedisHooks):
    @pytest.fixture
    def make_tier(self, redis_cluster: RedisClusterServers) -> Iterator[MakeTier]:
        for node in redis_cluster.nodes:
            flush(node.port)

        def make(**options: Any) -> Tier:
            return RedisTier(
                url=redis_cluster.url, cluster=True, **{"namespace": NAMESPACE, **options}
            )

        with self.connected(redis_cluster):
            yield make

    @pytest.fixture
    def store_down(self) -> StoreDown:
        return lambda tier: stopped(self.server)


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


@pytest.mark.parametrize("path", ["fast", "redis-py", "cluster"])
def test_a_ttl_of_milliseconds_is_kept_to_the_millisecond(
    path: str, request: pytest.FixtureRequest
) -> None:
    """`ttl: 250ms` was sent as `EX 1` (rounded up to whole seconds, silently): now `PX 250`,
    on every path a SET takes (kvtier's RESP client and redis-py, one block and a pipelined
    batch, a Redis Cluster), and the blocks are gone after it."""
    options: dict[str, Any] = {"ttl": "250ms"}
    server: RedisServer | RedisClusterServers
    if path == "cluster":
        server = request.getfixturevalue("redis_cluster")
        raw: Any = redis.RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
        options["cluster"] = True
    else:
        server = request.getfixturevalue("redis_server")
        raw = redis.Redis(host="127.0.0.1", port=server.port)
        options["fast_path"] = path == "fast"
    raw.flushall()

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=server.url, **options) as tier:
            assert (tier._fast is not None) == (path == "fast")
            await tier.put(key(0), payload(8192, 0))
            await tier.put_many([(key(i), payload(8192, i)) for i in (1, 2, 3)])
            for i in range(4):
                assert 0 < raw.pttl(name(key(i))) <= 250, i
            await asyncio.sleep(0.5)
            assert await tier.contains([key(i) for i in range(4)]) == [False] * 4

    try:
        asyncio.run(body())
    finally:
        raw.close()


def test_a_ttl_that_is_not_whole_milliseconds_is_refused() -> None:
    """Redis expires keys by the millisecond: a finer ttl would be rounded, so it is refused."""
    for ttl in ("0.5ms", "1.5ms", 0.0001):
        with pytest.raises(ConfigError, match=r"^ttl: a whole number of milliseconds"):
            RedisTier(namespace=NAMESPACE, ttl=ttl)
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.ttl: a whole number of milliseconds"):
        parse_config({"tiers": [{"name": "r", "type": "redis", "ttl": "0.5ms"}]})
    tier = RedisTier(namespace=NAMESPACE, ttl=0.007)  # 7.000000000000001 ms: float error
    assert tier._px() == 7
    asyncio.run(tier.close())


def test_keys_are_prefixed_by_namespace(redis_server: RedisServer) -> None:
    flush(redis_server.port)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url) as tier:
            await tier.put(key(1), b"v")
        client = redis.Redis(host="127.0.0.1", port=redis_server.port)
        assert sorted(client.keys()) == [
            f"kvtier:{NAMESPACE.hex()}".encode(),  # its last-write marker (`tiers.redis.usage`)
            f"kvtier:{NAMESPACE.hex()}:{key(1).hex()}".encode(),
        ]
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
    import tiers.redis.pipelines

    # The whole batch in one pipeline, as this test is about: split over several connections,
    # the values waiting in their query buffers count as used memory too, and the server may
    # refuse every SET before running any (it did, in one CI run).
    monkeypatch.setattr(tiers.redis.pipelines, "PIPELINE_BYTES", 64 << 20)
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
            assert all(isinstance(o, TierFull) and "OOM" in str(o) for o in refused)
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


@pytest.mark.parametrize("streams", [1, 3])
def test_a_batch_of_large_blocks_goes_as_several_pipelines_at_most_streams_at_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, streams: int
) -> None:
    """Past `PIPELINE_BYTES` of values a batch is split into pipelines, at most `streams` of
    them at once on as many connections (one connection carries its replies one after
    another), each value still landing in its own buffer. Not more than `streams`, whatever
    `concurrency` allows: against one single-threaded server, 32 connections at once halved a
    64 MiB batch's throughput (BENCHMARKS.md)."""
    import tiers.redis.pipelines
    import tiers.redis.resp_pool

    flush(redis_server.port)
    monkeypatch.setattr(tiers.redis.pipelines, "PIPELINE_BYTES", 100_000)  # one 64 KiB block each
    size = 64 << 10
    opened = 0
    connect = tiers.redis.resp_pool.RespPool._connect

    async def counted(self: Any) -> Any:
        nonlocal opened
        opened += 1
        return await connect(self)

    monkeypatch.setattr(tiers.redis.resp_pool.RespPool, "_connect", counted)

    async def body() -> None:
        async with RedisTier(
            namespace=NAMESPACE, url=redis_server.url, concurrency=16, streams=streams
        ) as tier:
            fast = tier._fast
            assert fast is not None
            items = [(key(i), payload(size, i)) for i in range(24)]
            assert await tier.put_many(items) == [None] * 24
            assert len(fast._idle) == opened == streams  # that many were in use at once
            buffers = [bytearray(size) for _ in range(24)]
            found = await tier.get_many([(key(i), b) for i, b in enumerate(buffers)])
            assert found == [True] * 24
            assert opened == streams
            assert all(bytes(b) == payload(size, i) for i, b in enumerate(buffers))
            assert tier.counters["puts"] == 24 and tier.counters["hits"] == 24

    asyncio.run(body())


def test_a_batch_waiting_for_its_streams_is_bounded_by_the_deadline(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline's wait for one of the batch's `streams` counts against its deadline, as the
    connection pool's wait does: a slow server fails the blocks still queued within the
    deadline (misses), instead of a batch taking its pipelines' count times as long."""
    import tiers.redis.pipelines
    import tiers.redis.resp_pool

    flush(redis_server.port)
    monkeypatch.setattr(tiers.redis.pipelines, "PIPELINE_BYTES", 100_000)  # one 64 KiB block each
    size = 64 << 10
    run = tiers.redis.resp_pool.RespPool.run

    async def slow(self: Any, exchange: Any) -> Any:
        await asyncio.sleep(0.2)  # a server that takes 0.2 s per pipeline
        return await run(self, exchange)

    async def body() -> None:
        async with RedisTier(
            namespace=NAMESPACE, url=redis_server.url, streams=1, timeout=0.5
        ) as tier:
            assert await tier.put_many([(key(i), payload(size, i)) for i in range(6)]) == [None] * 6
            monkeypatch.setattr(tiers.redis.resp_pool.RespPool, "run", slow)
            buffers = [bytearray(size) for _ in range(6)]
            start = time.monotonic()
            found = await tier.get_many([(key(i), b) for i, b in enumerate(buffers)])
            took = time.monotonic() - start
            assert took < 0.9, took  # six pipelines one after another would take 1.2 s
            assert found[0] is True and bytes(buffers[0]) == payload(size, 0)
            assert isinstance(found[-1], TierTimeout)
            assert all(f is True or isinstance(f, TierTimeout) for f in found)

    asyncio.run(body())


# -- a failed handshake (issue 15, item 10) -------------------------------------------------------


class LoopWatch:
    """What a test's event loop was left with: the fds the RESP client registered readers for
    that are still registered, and the callback errors the loop reported."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.registered: set[int] = set()
        self.errors: list[str] = []
        add_reader = loop.add_reader

        def counted(fd: Any, *args: Any) -> None:
            self.registered.add(fd)
            add_reader(fd, *args)

        loop.add_reader = counted  # type: ignore[method-assign]
        loop.set_exception_handler(lambda _, context: self.errors.append(str(context)))

    def left(self) -> set[int]:
        selector = self.loop._selector  # type: ignore[attr-defined]
        return self.registered & set(selector.get_map())


def set_requirepass(server: RedisServer, current: str, new: str) -> None:
    admin = redis.Redis(host="127.0.0.1", port=server.port, password=current)
    admin.config_set("requirepass", new)
    admin.close()


def test_a_wrong_password_is_reported_as_such_leaves_no_reader_and_recovers(
    auth_server: RedisServer,
) -> None:
    """Every call fails with the server's WRONGPASS (not a later `[Errno 2]` from a reader
    left registered on the closed socket, nor a flood of loop callback errors), and once the
    server takes the tier's password the same tier object works."""
    flush(auth_server.port, "s3cret")
    url = f"redis://:wrong-pass@127.0.0.1:{auth_server.port}/0"

    async def body() -> None:
        watch = LoopWatch(asyncio.get_running_loop())
        async with RedisTier(namespace=NAMESPACE, url=url, concurrency=2) as tier:
            assert tier._fast is not None
            for _ in range(3):
                for call in (
                    tier.put(key(1), payload(4096, 1)),
                    tier.get(key(1), bytearray(4096)),
                ):
                    with pytest.raises(TierUnavailable, match="WRONGPASS"):
                        await call
                (outcome,) = await tier.get_many([(key(1), bytearray(4096))])
                assert isinstance(outcome, TierUnavailable) and "WRONGPASS" in str(outcome)
            await asyncio.sleep(0.2)  # a reader left on a closed fd fires meanwhile
            assert watch.registered and not watch.left()
            assert watch.errors == []
            set_requirepass(auth_server, "s3cret", "wrong-pass")
            try:
                await tier.put(key(1), payload(4096, 1))
                assert await tier.get_bytes(key(1), 4096) == payload(4096, 1)
            finally:
                set_requirepass(auth_server, "wrong-pass", "s3cret")
            assert watch.errors == []

    asyncio.run(body())


def test_a_server_closing_the_socket_during_the_handshake_leaves_no_reader_then_recovers(
    tmp_path: Path,
) -> None:
    """A peer that accepts, reads the AUTH and hangs up: the error says so, nothing stays
    registered on the loop, and once a real server answers on that address the tier works."""
    server = RedisServer(tmp_path / "redis", password="s3cret")

    async def body() -> None:
        watch = LoopWatch(asyncio.get_running_loop())

        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.close()

        peer = await asyncio.start_server(hang_up, "127.0.0.1", server.port)
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        async with RedisTier(namespace=NAMESPACE, url=url, concurrency=2) as tier:
            for _ in range(3):
                with pytest.raises(TierUnavailable, match="closed the connection"):
                    await tier.put(key(1), payload(4096, 1))
                with pytest.raises(TierUnavailable, match="closed the connection"):
                    await tier.get(key(1), bytearray(4096))
            await asyncio.sleep(0.2)
            assert watch.registered and not watch.left()
            assert watch.errors == []
            peer.close()
            await peer.wait_closed()
            await asyncio.to_thread(server.start)
            await tier.put(key(1), payload(4096, 1))
            assert await tier.get_bytes(key(1), 4096) == payload(4096, 1)
            assert watch.errors == []

    try:
        asyncio.run(body())
    finally:
        server.stop()


def test_a_server_that_never_answers_the_handshake_fails_within_the_connect_timeout(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        writers: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)  # and never answers

        peer = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = peer.sockets[0].getsockname()[1]
        url = f"redis://:s3cret@127.0.0.1:{port}/0"
        async with RedisTier(namespace=NAMESPACE, url=url, connect_timeout=0.3) as tier:
            start = time.monotonic()
            with pytest.raises(TierUnavailable, match="within 0.3s"):
                await tier.get(key(1), bytearray(4096))
            assert time.monotonic() - start < 2
        for writer in writers:
            writer.close()
        peer.close()
        await peer.wait_closed()

    asyncio.run(body())


# -- objects larger than their block (issue 15, item 2) -------------------------------------------

BIG = 64 << 20


def peak_of(calls: Any) -> Any:
    """The coroutine `calls` awaited under tracemalloc: (its result, peak bytes allocated)."""

    async def traced() -> tuple[Any, int]:
        tracemalloc.start()
        try:
            result = await calls
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    return traced()


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_a_huge_object_for_a_small_block_is_refused_unread(
    redis_server: RedisServer, fast_path: bool
) -> None:
    """A 64 MiB value where a 4 KiB block belongs costs neither 64 MiB of memory nor its
    transfer: a `length` corrupt miss, deleted, and the connection pool still works."""
    flush(redis_server.port)

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            await tier.put(key(2), payload(4096, 2))
            plant(redis_server.port, key(1), bytes(BIG))
            found, peak = await peak_of(tier.get(key(1), bytearray(4096)))
            assert found is False and peak < 1 << 20, peak
            assert tier.counters["corrupt.length"] == 1
            assert stored(redis_server.port, key(1)) is None  # refused and deleted
            assert await tier.get_bytes(key(2), 4096) == payload(4096, 2)
            plant(redis_server.port, key(1), bytes(BIG))
            with pytest.raises(CorruptObject, match="length"):
                await tier._read(key(1), 8192)
            head = await tier.read_head(key(1))
            assert head is not None and head[1] == BIG and len(head[0]) == tier.header_room

    asyncio.run(body())


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_an_oversized_object_in_a_batch_fails_alone_and_the_others_arrive(
    redis_server: RedisServer, fast_path: bool
) -> None:
    """In one pipeline: a value a little too large is drained (the replies after it stay in
    step and are read into their own buffers), memory stays bounded."""
    import tiers.redis.pipelines

    flush(redis_server.port)
    size = 64 << 10

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            await tier.put_many([(key(i), payload(size, i)) for i in (1, 3)])
            plant(redis_server.port, key(2), bytes(tiers.redis.pipelines.DRAIN))
            pooled = set(map(id, tier._fast._idle)) if tier._fast is not None else set()
            buffers = [bytearray(size) for _ in range(3)]
            found, peak = await peak_of(
                tier.get_many([(key(i + 1), b) for i, b in enumerate(buffers)])
            )
            assert found == [True, False, True]
            assert bytes(buffers[0]) == payload(size, 1) and bytes(buffers[2]) == payload(size, 3)
            assert peak < 2 << 20, peak
            assert tier.counters["corrupt.length"] == 1
            assert stored(redis_server.port, key(2)) is None
            if tier._fast is not None:  # drained: the same connection, no new one
                assert set(map(id, tier._fast._idle)) == pooled

    asyncio.run(body())


def test_a_huge_object_in_a_fast_pipeline_costs_a_connection_not_its_size(
    redis_server: RedisServer,
) -> None:
    """Past `DRAIN` the value is not read at all: its connection is dropped and the GETs after
    it are sent again on another, so every other block of the batch still arrives."""
    import tiers.redis.pipelines

    flush(redis_server.port)
    size = 64 << 10

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url) as tier:
            assert tier._fast is not None
            await tier.put_many([(key(i), payload(size, i)) for i in (1, 3, 5)])
            for i in (2, 4):
                plant(redis_server.port, key(i), bytes(BIG))
            assert BIG > tiers.redis.pipelines.DRAIN
            buffers = [bytearray(size) for _ in range(5)]
            found, peak = await peak_of(
                tier.get_many([(key(i + 1), b) for i, b in enumerate(buffers)])
            )
            assert found == [True, False, True, False, True]
            assert all(bytes(buffers[i - 1]) == payload(size, i) for i in (1, 3, 5))
            assert peak < 1 << 20, peak
            assert tier.counters["corrupt.length"] == 2 and tier.counters["errors"] == 0
            assert (
                stored(redis_server.port, key(2)) is None
                and stored(redis_server.port, key(4)) is None
            )
            assert len(tier._fast._idle) >= 1  # the pool goes on

    asyncio.run(body())


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_read_head_reads_the_header_and_the_real_size(
    redis_server: RedisServer, fast_path: bool
) -> None:
    flush(redis_server.port)

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            await tier.put(key(1), payload(64 << 10, 1))
            blob = stored(redis_server.port, key(1))
            assert blob is not None
            assert await tier.read_head(key(1)) == (blob[: tier.header_room], len(blob))
            assert await tier.read_head(key(2)) is None
            plant(redis_server.port, key(3), b"")
            assert await tier.read_head(key(3)) == (b"", 0)

    asyncio.run(body())


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_an_empty_value_is_refused_and_deleted_a_missing_key_is_a_plain_miss(
    redis_server: RedisServer, fast_path: bool
) -> None:
    """On both transports alike (redis-py reads a bounded GETRANGE, where an empty reply is
    either: EXISTS tells), single and batched."""
    flush(redis_server.port)

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            plant(redis_server.port, key(1), b"")
            assert await tier.get(key(1), bytearray(4096)) is False
            assert await tier.get(key(2), bytearray(4096)) is False
            plant(redis_server.port, key(1), b"")
            assert await tier.get_many([(key(1), bytearray(4096)), (key(2), bytearray(4096))]) == [
                False,
                False,
            ]
            assert tier.counters["corrupt.truncated"] == 2 and tier.counters["misses"] == 4
            assert await tier.contains([key(1)]) == [False]  # refused objects are deleted

    asyncio.run(body())


def test_foreign_names_in_a_shared_redis_are_skipped_and_counted(
    redis_server: RedisServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Anyone who can write to a shared Redis can add a name under kvtier's prefix that no
    kvtier wrote (not hex, not UTF-8): listings skip and count it, and `kvtier ls` and
    `kvtier verify` go on to the real blocks instead of aborting."""
    from kvtier.cli import main

    flush(redis_server.port)
    prefix = f"kvtier:{NAMESPACE.hex()}:".encode()
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.set(prefix + b"zz-not-hex", b"x")
    client.set(prefix + b"\xff\xfe", b"x")
    client.close()

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url) as tier:
            await tier.put(key(1), payload(4096, 1))
            assert [k async for k in tier.keys()] == [key(1)]
            assert tier.counters["foreign_names"] == 2

    asyncio.run(body())
    config = tmp_path / "c.yaml"
    config.write_text(f"tiers:\n  - {{name: r, type: redis, url: '{redis_server.url}'}}\n")
    assert main(["ls", "--config", str(config), "--tier", "r", "--json"]) == 0
    assert main(["verify", "--config", str(config), "--tier", "r"]) == 0
    out = capsys.readouterr().out
    assert key(1).hex() in out and "1 ok" in out


# -- objects an attacker plants (header only, a key of another type) ------------------------------


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_a_header_only_object_is_a_truncated_miss_not_the_untouched_buffer(
    redis_server: RedisServer, fast_path: bool
) -> None:
    """An object cut at its payload offset, whose header claims a raw block of the buffer's
    size with the checksum of what the buffer already holds (zeros): its header is not a
    placed payload, and the untouched buffer is never served as a hit."""
    flush(redis_server.port)
    size = 4096
    blob = craft(key(1), b"", stored=size, raw=size, checksum_of=bytes(size))

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            plant(redis_server.port, key(1), blob)
            assert await tier.get(key(1), bytearray(size)) is False
            assert stored(redis_server.port, key(1)) is None  # refused and deleted
            plant(redis_server.port, key(1), blob)
            await tier.put(key(2), payload(size, 2))
            buffers = [bytearray(size), bytearray(size)]
            found = await tier.get_many([(key(1), buffers[0]), (key(2), buffers[1])])
            assert found == [False, True]
            assert bytes(buffers[1]) == payload(size, 2)
            assert tier.counters["corrupt.truncated"] == 2 and tier.counters["hits"] == 1
            assert stored(redis_server.port, key(1)) is None

    asyncio.run(body())


def plant_list(port: int, k: BlockKey) -> None:
    """A Redis list where the string of block `k` belongs (`DEL` then `RPUSH`)."""
    client = redis.Redis(host="127.0.0.1", port=port)
    client.delete(name(k))
    client.rpush(name(k), b"not", b"a block")
    client.close()


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_a_key_that_is_not_a_string_is_a_corrupt_miss_for_its_block_alone(
    redis_server: RedisServer, fast_path: bool
) -> None:
    """A list planted under a block's key (WRONGTYPE to GET, GETRANGE and STRLEN): that block
    is a `magic` corrupt miss and is deleted, every other block of the batch arrives (on the fast
    path, read after the error reply on the same connection), the batch is no fault for the
    breaker, and `stat` still answers."""
    flush(redis_server.port)
    size = 4096
    bad = (0, 5)  # the first of a batch: the fast path failed every item after it

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            await tier.put_many([(key(i), payload(size, i)) for i in range(8)])
            for i in bad:
                plant_list(redis_server.port, key(i))
            pooled = set(map(id, tier._fast._idle)) if tier._fast is not None else set()
            buffers = [bytearray(size) for _ in range(8)]
            found = await tier.get_many([(key(i), b) for i, b in enumerate(buffers)])
            assert found == [i not in bad for i in range(8)]
            assert all(bytes(buffers[i]) == payload(size, i) for i in range(8) if i not in bad)
            assert fault_of(found) is None
            assert tier.counters["corrupt.magic"] == 2 and tier.counters["errors"] == 0
            assert await tier.contains([key(i) for i in bad]) == [False, False]  # deleted
            plant_list(redis_server.port, key(0))
            assert await tier.get(key(0), bytearray(size)) is False
            assert tier.counters["corrupt.magic"] == 3 and tier.counters["errors"] == 0
            assert await tier.contains([key(0)]) == [False]
            if tier._fast is not None:  # in step after the error replies: no new connection
                assert set(map(id, tier._fast._idle)) == pooled
            plant_list(redis_server.port, key(0))
            with pytest.raises(CorruptObject, match="magic: not a string value: WRONGTYPE"):
                await tier.read_object(key(0))
            with pytest.raises(CorruptObject, match="magic"):
                await tier.read_head(key(0))
            one = stored(redis_server.port, key(1))
            assert one is not None
            # six blocks, and the list at key(0) (of no bytes): key(5) was deleted
            assert await tier.stat() == TierStat(7, 6 * len(one), None)
            assert await tier.get_bytes(key(1), size) == payload(size, 1)

    asyncio.run(body())


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_operators_commands_report_a_key_that_is_not_a_string(
    redis_server: RedisServer, fast_path: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier stats` and `ls` answer, `verify` names the planted list as a bad block (and
    deletes it with `--repair`) instead of failing with an error."""
    from kvtier.cli import main

    flush(redis_server.port)

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, url=redis_server.url, fast_path=fast_path)
        async with tier:
            await tier.put_many([(key(i), payload(4096, i)) for i in range(3)])

    asyncio.run(body())
    plant_list(redis_server.port, key(1))
    config = tmp_path / "c.yaml"
    config.write_text(
        f"tiers:\n  - {{name: r, type: redis, url: '{redis_server.url}', "
        f"fast_path: {str(fast_path).lower()}}}\n"
    )
    where = ["--config", str(config), "--tier", "r"]
    capsys.readouterr()
    assert main(["stats", *where, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["objects"] == 3  # the list among them, of no bytes
    assert main(["ls", *where]) == 0
    assert "magic: not a string value" in capsys.readouterr().out
    assert main(["verify", *where]) == 1  # a bad block found, as for any damaged object
    captured = capsys.readouterr()
    assert "3 blocks: 2 ok, 1 bad" in captured.out and f"{key(1).hex()}: magic" in captured.out
    assert "error" not in captured.err
    assert main(["verify", "--repair", *where]) == 0
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert client.exists(f"kvtier:{NAMESPACE.hex()}:{key(1).hex()}") == 0
    client.close()


def test_a_fast_path_connection_takes_a_large_receive_buffer(redis_server: RedisServer) -> None:
    """A promotion's replies arrive faster than the tier's thread, sharing the GIL with the
    engine's, takes them: a 4 MiB receive buffer (asked before connecting, so that the window
    scales) lets more arrive between two of its reads (bench/ttft.py: Redis promotions 0.88 ->
    1.03-1.29 GiB/s inside the engine)."""
    import socket

    import tiers.redis.resp

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_server.url) as tier:
            assert tier._fast is not None
            await tier.put(key(1), payload(4096, 1))
            assert await tier.get(key(1), bytearray(4096)) is True
            (conn,) = tier._fast._idle
            got = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            assert got >= min(tiers.redis.resp.RCVBUF, rmem_max()), got

    asyncio.run(body())


def rmem_max() -> int:
    """The largest receive buffer an unprivileged socket may ask for (Linux doubles what it is
    asked for, up to twice this)."""
    try:
        return int(Path("/proc/sys/net/core/rmem_max").read_text())
    except OSError:
        return 0
