"""A Redis tier's `capacity` against what the server guarantees (issue 28, item 4): at its first
call a writable tier reads `maxmemory` and `maxmemory-policy` (every master of a Cluster) and
says in one line what to set where the server cannot hold the store to it, or that it could
not check; a server full under `noeviction` refuses writes as `TierFull` on every path, and
the manager's write breaker keeps promotions going. On real servers configured each way."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.servers import RedisClusterServers, RedisServer
from tests.helpers.breaker_engine import FAILURES, Engine, k
from tiering.errors import TierError, TierFull
from tiering.primary import LookupResult
from tiering.testing import NAMESPACE, key, payload
from tiers.redis import RedisTier
from tiers.redis import bounds as redis_bounds
from tiers.redis.bounds import ServerMemory, advise, judge, redis_size
from tiers.redis.pipelines import PIPELINE_MAX_VALUE

pytestmark = pytest.mark.redis

GiB = 1 << 30
HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server of this module's own: its memory settings change from test to test."""
    own = RedisServer(tmp_path_factory.mktemp("redis-bounds"))
    own.start()
    yield own
    own.stop()


def configure(
    port: int, maxmemory: int | str, policy: str = "noeviction", samples: int = 64
) -> None:
    """The server's memory settings (sampling 64 keys unless said: no `advise` line)."""
    client = redis.Redis(host="127.0.0.1", port=port)
    client.config_set("maxmemory", maxmemory)
    client.config_set("maxmemory-policy", policy)
    client.config_set("maxmemory-samples", samples)
    client.close()


@pytest.fixture
def fresh(server: RedisServer) -> Iterator[RedisServer]:
    """The module's server, empty and unbounded after the test whatever it set."""
    yield server
    configure(server.port, 0)
    client = redis.Redis(host="127.0.0.1", port=server.port)
    client.flushall()
    client.close()


@pytest.fixture
def cluster(redis_cluster: RedisClusterServers) -> Iterator[RedisClusterServers]:
    yield redis_cluster
    for node in redis_cluster.nodes:
        configure(node.port, 0)
        client = redis.Redis(host="127.0.0.1", port=node.port)
        client.flushall()
        client.close()


def findings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiers.redis.bounds"]


async def first_call(tier: RedisTier) -> str | None:
    """The tier's first call, and what its background check said once it has ended."""
    await tier.contains([key(0)])
    await tier.bounds.wait()
    return tier.bounds.finding


# -- the judgement, pure --------------------------------------------------------------------------


def test_what_a_server_cannot_guarantee_is_said_with_what_to_set() -> None:
    one = [ServerMemory("h:1", 0, "noeviction")]
    assert judge(8 * GiB, None, one) == (
        "capacity 8GiB is not guaranteed by the server: maxmemory 0 (no bound) on h:1; "
        "maxmemory-policy noeviction on h:1 (never evicts kvtier's blocks); "
        "set maxmemory 8gb and maxmemory-policy allkeys-lru on it"
    )
    assert judge(8 * GiB, None, [ServerMemory("h:1", 8 * GiB, "allkeys-lru")]) is None
    assert judge(8 * GiB, None, [ServerMemory("h:1", 4 * GiB, "allkeys-lfu")]) is None
    masters = [ServerMemory(f"h:{i}", 4 * GiB, "allkeys-lru") for i in range(3)]
    assert judge(9 * GiB, None, masters) == (
        "capacity 9GiB is not guaranteed by the server: the masters' maxmemory add up to "
        "12GiB, more than the capacity; set maxmemory 3gb on each of its 3 masters"
    )
    assert judge(12 * GiB, None, masters) is None
    assert judge(None, None, one) is None  # no capacity claimed: no bound is the operator's call


def test_a_policy_that_never_evicts_kvtiers_keys_is_said_even_without_a_capacity() -> None:
    volatile = [ServerMemory("h:1", GiB, "volatile-lru")]
    assert judge(GiB, None, volatile) == (
        "capacity 1GiB is not guaranteed by the server: maxmemory-policy volatile-lru on h:1 "
        "(never evicts kvtier's blocks: without ttl kvtier's keys never expire); "
        "set maxmemory-policy allkeys-lru on it"
    )
    assert judge(GiB, 3600.0, volatile) is None  # with a ttl every block has an expiry
    assert judge(None, None, [ServerMemory("h:1", GiB, "noeviction")]) == (
        "the server refuses new blocks once full: maxmemory-policy noeviction on h:1 "
        "(never evicts kvtier's blocks); set maxmemory-policy allkeys-lru on it"
    )


def test_an_eviction_that_samples_few_keys_is_told_to_sample_64() -> None:
    """Redis evicts the oldest of `maxmemory-samples` sampled keys: with 5 a shared tier keeps
    3-6 points less of what a fleet uses than with 64 (BENCHMARKS.md, the fleet replay)."""
    assert advise([ServerMemory("h:1", GiB, "allkeys-lru", 5)]) == (
        "maxmemory-samples 5 on h:1: allkeys-lru evicts the oldest of a few sampled keys, not "
        "the oldest of all (3-6 points of hit rate below exact LRU for a fleet); set "
        "maxmemory-samples 64"
    )
    assert advise([ServerMemory("h:1", GiB, "allkeys-lru", 64)]) is None
    assert advise([ServerMemory("h:1", GiB, "noeviction", 5)]) is None  # judge's business
    assert advise([ServerMemory("h:1", GiB, "allkeys-random", 5)]) is None
    masters = [ServerMemory(f"h:{i}", GiB, "allkeys-lfu", 10) for i in range(3)]
    assert "on 3 masters" in (advise(masters) or "")


def test_a_real_servers_sampling_is_read_and_advised(fresh: RedisServer) -> None:
    client = redis.Redis(host="127.0.0.1", port=fresh.port)
    configure(fresh.port, GiB, "allkeys-lru")

    async def advice() -> str | None:
        async with RedisTier(namespace=NAMESPACE, url=fresh.url, capacity=GiB) as tier:
            await first_call(tier)
            return tier.bounds.advice

    try:
        client.config_set("maxmemory-samples", 5)  # Redis's default
        assert "set maxmemory-samples 64" in (asyncio.run(advice()) or "")
        client.config_set("maxmemory-samples", 64)
        assert asyncio.run(advice()) is None
    finally:
        client.close()


def test_sizes_are_suggested_in_redis_conf_units() -> None:
    assert [redis_size(n) for n in (8 * GiB, 3 << 20, 5 << 10, 1000)] == [
        "8gb",
        "3mb",
        "5kb",
        "1000",
    ]


# -- real servers ---------------------------------------------------------------------------------

CASES = {
    "unbounded, noeviction": (
        0,
        "noeviction",
        GiB,
        None,
        "capacity 1GiB is not guaranteed by the server: maxmemory 0 (no bound) on {where}; "
        "maxmemory-policy noeviction on {where} (never evicts kvtier's blocks); "
        "set maxmemory 1gb and maxmemory-policy allkeys-lru on it",
    ),
    "larger than the capacity": (
        "2gb",
        "allkeys-lru",
        GiB,
        None,
        "capacity 1GiB is not guaranteed by the server: maxmemory 2GiB, more than the "
        "capacity; set maxmemory 1gb on it",
    ),
    "volatile without ttl": (
        "1gb",
        "volatile-lfu",
        GiB,
        None,
        "capacity 1GiB is not guaranteed by the server: maxmemory-policy volatile-lfu on "
        "{where} (never evicts kvtier's blocks: without ttl kvtier's keys never expire); "
        "set maxmemory-policy allkeys-lru on it",
    ),
    "volatile with ttl": ("1gb", "volatile-lfu", GiB, "1h", None),
    "bounded, allkeys-lru": ("512mb", "allkeys-lru", GiB, None, None),
    "no capacity, unbounded": (0, "noeviction", None, None, None),
    "no capacity, full refuses": (
        "1gb",
        "noeviction",
        None,
        None,
        "the server refuses new blocks once full: maxmemory-policy noeviction on {where} "
        "(never evicts kvtier's blocks); set maxmemory-policy allkeys-lru on it",
    ),
}


@pytest.mark.parametrize("transport", ["resp", "redis-py"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_server_configured_each_way_gets_its_one_line(
    fresh: RedisServer, caplog: pytest.LogCaptureFixture, case: str, transport: str
) -> None:
    maxmemory, policy, capacity, ttl, expected = CASES[case]
    configure(fresh.port, maxmemory, policy)
    where = f"127.0.0.1:{fresh.port}"
    caplog.set_level(logging.INFO, "tiers.redis.bounds")

    async def body() -> None:
        tier = RedisTier(
            namespace=NAMESPACE,
            name="shared",
            url=fresh.url,
            capacity=capacity,
            ttl=ttl,
            fast_path=transport == "resp",
        )
        async with tier:
            said = await first_call(tier)
            for i in range(3):  # later calls check nothing more
                await tier.put(key(i), payload(1024, i))
                await tier.get(key(i), bytearray(1024))
            await tier.bounds.wait()
        if expected is None:
            assert said is None and findings(caplog) == []
        else:
            line = f"tier 'shared': {expected.format(where=where)}"
            assert said == line and findings(caplog) == [line]
            assert [r.levelno for r in caplog.records if r.name == "tiers.redis.bounds"] == [
                logging.WARNING
            ]

    asyncio.run(body())


def test_every_master_of_a_cluster_is_read(
    cluster: RedisClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    """Three masters of 1gb each hold a 3 GiB capacity; one of them unbounded does not, and is
    named."""
    for node in cluster.nodes:
        configure(node.port, "1gb", "allkeys-lru")

    async def check() -> str | None:
        async with RedisTier(
            namespace=NAMESPACE, url=cluster.url, cluster=True, capacity=3 * GiB
        ) as tier:
            return await first_call(tier)

    assert asyncio.run(check()) is None
    configure(cluster.nodes[1].port, 0, "allkeys-lru")
    assert asyncio.run(check()) == (
        f"tier 'redis': capacity 3GiB is not guaranteed by the server: maxmemory 0 (no bound) "
        f"on 127.0.0.1:{cluster.nodes[1].port}; set maxmemory 1gb on each of its 3 masters"
    )


def test_a_server_that_refuses_config_gets_one_line_and_the_tier_works(
    fresh: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A user without CONFIG (as on many managed services): one line that the bounds could not
    be checked and what to make sure of; blocks still go in and out."""
    admin = redis.Redis(host="127.0.0.1", port=fresh.port)
    admin.execute_command("ACL", "SETUSER", "engine", "on", ">pw", "~*", "+@all", "-config")
    try:

        async def body() -> None:
            tier = RedisTier(
                namespace=NAMESPACE, url=fresh.url, username="engine", password="pw", capacity=GiB
            )
            async with tier:
                said = await first_call(tier)
                assert said == (
                    "tier 'redis': cannot check that the server bounds its memory (CONFIG GET "
                    "refused: this user has no permissions to run the 'config|get' command); "
                    "make sure of maxmemory 1gb at most and maxmemory-policy allkeys-lru on it"
                )
                await tier.put(key(1), payload(1024, 1))
                assert await tier.get_bytes(key(1), 1024) == payload(1024, 1)
                await tier.contains([key(1)])
                await tier.bounds.wait()
            assert findings(caplog) == [said]

        asyncio.run(body())
    finally:
        admin.execute_command("ACL", "DELUSER", "engine")
        admin.close()


def config_calls(port: int) -> int:
    client = redis.Redis(host="127.0.0.1", port=port)
    stats = client.info("commandstats")
    client.close()
    return int(stats.get("cmdstat_config|get", {}).get("calls", 0))


def test_a_read_only_tier_checks_nothing(fresh: RedisServer) -> None:
    """Operators' commands open tiers read-only: they write nothing, so no bound is theirs to
    check (and they send no CONFIG)."""
    before = config_calls(fresh.port)

    async def body() -> None:
        async with RedisTier(
            namespace=NAMESPACE, url=fresh.url, capacity=GiB, read_only=True
        ) as tier:
            assert await first_call(tier) is None

    asyncio.run(body())
    assert config_calls(fresh.port) == before


def test_a_server_down_at_start_is_checked_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(redis_bounds, "RETRY_AFTER", 0.2)
    later = RedisServer(tmp_path / "redis")  # its port, not started yet

    async def body() -> None:
        async with RedisTier(
            namespace=NAMESPACE, url=later.url, capacity=GiB, connect_timeout=0.2, timeout=1.0
        ) as tier:
            with pytest.raises(TierError):
                await tier.contains([key(0)])
            await tier.bounds.wait()
            assert tier.bounds.finding is None
            await asyncio.to_thread(later.start)
            await asyncio.sleep(0.3)
            assert await first_call(tier) is not None
        assert len(findings(caplog)) == 1 and "maxmemory 0 (no bound)" in findings(caplog)[0]

    try:
        asyncio.run(body())
    finally:
        later.stop()


# -- a full server --------------------------------------------------------------------------------


@contextlib.contextmanager
def full(*ports: int) -> Iterator[None]:
    """Each server out of room under `noeviction` (maxmemory below what it uses now)."""
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port)
        configure(port, int(client.info("memory")["used_memory"]) // 2, "noeviction")
        client.close()
    try:
        yield
    finally:
        for port in ports:
            configure(port, 0)


PATHS: dict[str, dict[str, Any]] = {
    "resp": {"fast_path": True},
    "redis-py": {"fast_path": False},
}


@pytest.mark.parametrize("transport", list(PATHS))
def test_a_full_server_refuses_writes_as_tier_full_and_serves_what_it_holds(
    fresh: RedisServer, transport: str
) -> None:
    """One block, a pipelined batch, and a batch of blocks too large for one pipeline: every
    refused SET is `TierFull` (for the write breaker), counted; reads go on."""
    big = PIPELINE_MAX_VALUE + 1

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=fresh.url, **PATHS[transport]) as tier:
            await tier.put(key(0), payload(4096, 0))
            with full(fresh.port):
                with pytest.raises(TierFull, match="the server is full"):
                    await tier.put(key(1), payload(4096, 1))
                for size in (4096, big):
                    outcomes = await tier.put_many([(key(i), payload(size, i)) for i in (2, 3)])
                    assert all(isinstance(o, TierFull) for o in outcomes), outcomes
                assert tier.counters["errors"] == 5
                assert await tier.get_bytes(key(0), 4096) == payload(4096, 0)
                assert await tier.contains([key(0), key(1)]) == [True, False]

    asyncio.run(body())


def test_a_full_cluster_refuses_writes_as_tier_full(cluster: RedisClusterServers) -> None:
    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=cluster.url, cluster=True) as tier:
            await tier.put(key(0), payload(4096, 0))
            with full(*(n.port for n in cluster.nodes)):
                with pytest.raises(TierFull):
                    await tier.put(key(1), payload(4096, 1))
                outcomes = await tier.put_many([(key(i), payload(4096, i)) for i in range(2, 8)])
                assert all(isinstance(o, TierFull) for o in outcomes), outcomes
                assert await tier.get_bytes(key(0), 4096) == payload(4096, 0)

    asyncio.run(body())


def test_a_full_server_opens_the_write_breaker_and_promotions_go_on(fresh: RedisServer) -> None:
    """Through the manager: demotions to a full Redis fail as `TierFull`, which opens the
    write breaker alone; the tier's breaker stays closed and a block stored before is promoted
    from it."""
    tier = RedisTier(
        namespace=NAMESPACE, name="redis", url=fresh.url, socket_timeout=0.5, connect_timeout=0.5
    )
    engine = Engine(tier)
    try:
        for i in range(8):
            engine.store(i)
        assert engine.figures()["demotions"] == 8
        with full(fresh.port):
            for i in range(8, 8 + FAILURES):  # evicts 0-2 from the primary
                engine.store(i)
            figures = engine.figures()
            assert figures["write_breaker"] == "open" and figures["breaker"] == "closed", figures
            assert figures["demotion_failures"] == FAILURES
            assert engine.manager.pool.lookup(k(0)) is MISS
            assert engine.fetch(0) is HIT  # promoted from the full server
            assert int(engine.memory[engine.manager.pool.slot(k(0))][0]) == 0
    finally:
        engine.close()


def test_the_readmes_redis_conf_makes_a_server_that_bounds_the_capacity(fresh: RedisServer) -> None:
    """The lines README.md gives for running Redis as a bounded cache, set on a real server,
    are what the check asks for: no line for the capacity they name, nor on its sampling."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- redis-bounded:begin -->")[1].split("<!-- redis-bounded:end -->")[0]
    lines = [line for line in block.strip().strip("`").splitlines() if line and line[0] != "#"]
    settings = dict(line.split(maxsplit=1) for line in lines)
    assert set(settings) == {"maxmemory", "maxmemory-policy", "maxmemory-samples"}
    samples = int(settings["maxmemory-samples"])
    configure(fresh.port, settings["maxmemory"], settings["maxmemory-policy"], samples)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=fresh.url, capacity="64GiB") as tier:
            assert await first_call(tier) is None
            assert tier.bounds.advice is None

    asyncio.run(body())
