"""The circuit breakers through the real manager and runtime, over real servers that stop: a dead
Redis, a stopped SeaweedFS and a full disk open them on demotions, promotions and existence
checks; while open, jobs are refused within milliseconds with no call to the tier; after the
cooldown one job probes; once the server is back the breaker closes. And `kvtier replay`'s
tiered path against a dead Redis ends with the breaker open."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.replay import replay_tiered
from kvtier.servers import RedisServer, SeaweedS3
from kvtier.trace import TraceRequest
from tests.helpers.breaker_engine import (
    BLOCK,
    COOLDOWN,
    FAILURES,
    HIT,
    MISS,
    REFUSAL_BOUND,
    Engine,
    k,
)
from tiering.config import BreakerConfig, Config, FaultsConfig, TierConfig
from tiering.errors import TierUnavailable
from tiering.keys import BlockKey
from tiering.primary import LookupResult
from tiering.runtime import Job
from tiering.testing import NAMESPACE
from tiering.tier import Tier


def redis_tier(server: RedisServer) -> Tier:
    from tiers.redis import RedisTier

    return RedisTier(
        namespace=NAMESPACE, name="redis", url=server.url, socket_timeout=0.5, connect_timeout=0.5
    )


def s3_tier(server: SeaweedS3) -> Tier:
    from tiers.s3 import S3Tier

    return S3Tier(
        namespace=NAMESPACE,
        name="s3",
        bucket=server.bucket,
        endpoint_url=server.endpoint,
        access_key=server.ACCESS_KEY,
        secret_key=server.SECRET_KEY,
        retries=1,
        connect_timeout=0.3,
        read_timeout=1.0,
    )


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("s3", marks=pytest.mark.s3),
    ]
)
def served(request: Any, tmp_path: Path) -> Iterator[tuple[Engine, Any]]:
    """An engine over a tier on a real server that the test stops and starts."""
    server: Any = (
        RedisServer(tmp_path / "redis", durable=True)
        if request.param == "redis"
        else SeaweedS3(tmp_path / "s3")
    )
    server.start()
    engine = Engine(redis_tier(server) if request.param == "redis" else s3_tier(server))
    try:
        yield engine, server
    finally:
        engine.close()
        server.stop()


def demotion(engine: Engine, i: int) -> Job:
    """A demotion job as the manager makes one (for timing a refusal)."""
    tier = engine.tier
    return Job(engine.name, lambda: tier.put_many([(k(i), bytes(BLOCK))]), 1.0, writes=True)


def check(engine: Engine, i: int) -> Job:
    tier = engine.tier
    return Job(engine.name, lambda: tier.contains([k(i)]), 1.0)


def promotion(engine: Engine, i: int) -> Job:
    tier = engine.tier
    return Job(engine.name, lambda: tier.get_many([(k(i), bytearray(BLOCK))]), 1.0)


def landed(engine: Engine, key: BlockKey, tries: int = 5) -> bool:
    """Whether the tier holds `key`, asked until it answers: right after a restart the client's
    pool may still hold a connection the old server closed, and that one call fails (a miss in
    the engine; here the question is whether the probe's block reached the store)."""
    for _ in range(tries):
        try:
            return engine.runtime.run_sync(lambda: engine.tier.contains([key]), 5.0) == [True]
        except TierUnavailable:
            time.sleep(0.05)
    return False


def test_a_dead_server_opens_the_breaker_on_demotions(served: tuple[Engine, Any]) -> None:
    engine, server = served
    engine.store(0)
    assert engine.figures()["demotions"] == 1
    server.stop()
    for i in range(1, 1 + FAILURES):  # each store's demotion fails
        engine.store(i)
    figures = engine.figures()
    assert figures["breaker"] == "open" and figures["write_breaker"] == "open"
    assert figures["demotion_failures"] == FAILURES
    calls = engine.calls()
    engine.store(10)  # refused: no call to the tier, a failed demotion all the same
    assert engine.calls() == calls and engine.figures()["demotion_failures"] == FAILURES + 1
    assert engine.figures()["write_breaker_refused"] == 1
    assert engine.refusal_seconds(demotion(engine, 11)) < REFUSAL_BOUND
    time.sleep(COOLDOWN)
    engine.store(12)  # the probe: one call, which fails; open for another cooldown
    figures = engine.figures()
    assert engine.calls() > calls and figures["demotion_failures"] == FAILURES + 2
    assert figures["breaker_opened"] == 2 and figures["write_breaker_opened"] == 2
    server.start()
    probes = engine.until_closed(lambda n: engine.store(100 + n), "write_breaker")
    assert engine.figures()["breaker"] == "closed"
    assert landed(engine, k(100 + probes))


def test_a_dead_server_opens_the_breaker_on_promotions(served: tuple[Engine, Any]) -> None:
    engine, server = served
    for i in range(16):  # 0-7 are demoted, then evicted from the 8 primary slots
        engine.store(i)
    assert engine.manager.pool.lookup(k(0)) is MISS and engine.manager.where(k(0)) == engine.name
    demoted = engine.figures()["demotions"]
    server.stop()
    for i in range(FAILURES):  # promoted from where they were demoted: each fails
        assert engine.fetch(i) is MISS
    figures = engine.figures()
    assert figures["breaker"] == "open" and figures["promotion_failures"] == FAILURES
    assert figures["write_breaker"] == "closed" and figures["demotions"] == demoted
    calls = engine.calls()
    assert engine.fetch(FAILURES) is MISS  # refused
    assert engine.calls() == calls and engine.figures()["breaker_refused"] == 1
    assert engine.refusal_seconds(promotion(engine, 7)) < REFUSAL_BOUND
    time.sleep(COOLDOWN)
    assert engine.fetch(FAILURES + 1) is MISS  # the probe fails
    assert engine.calls() > calls and engine.figures()["breaker_opened"] == 2
    server.start()
    keys = iter(range(FAILURES + 2, 8))
    engine.until_closed(lambda n: engine.fetch(next(keys)))
    assert engine.manager.pool.lookup(k(7)) is MISS
    assert engine.fetch(7) is HIT  # promoted again
    assert int(engine.memory[engine.manager.pool.slot(k(7))][0]) == 7


def test_a_dead_server_opens_the_breaker_on_checks(served: tuple[Engine, Any]) -> None:
    """Checks while the engine also stores (its write-through demotions fail too: each kind
    of job counts, none resets the other's failures)."""
    engine, server = served
    engine.store(0)
    engine.manager.reset()  # forgets where block 0 is: it must be looked for
    server.stop()
    for i in range(1, 1 + FAILURES):
        assert engine.manager.lookup(k(1000 + i)) is LookupResult.RETRY
        engine.store(i)  # the step submits the check and the demotion
    figures = engine.figures()
    assert figures["breaker"] == "open" and figures["lookups"] >= 1
    calls, refused = engine.calls(), figures["breaker_refused"]
    assert engine.fetch(2000) is MISS  # its check refused
    assert engine.calls() == calls and engine.figures()["breaker_refused"] == refused + 1
    assert engine.refusal_seconds(check(engine, 2001)) < REFUSAL_BOUND
    opened = engine.figures()["breaker_opened"]
    time.sleep(COOLDOWN)
    assert engine.fetch(2002) is MISS  # the probe: a check, which fails
    assert engine.calls() > calls and engine.figures()["breaker_opened"] == opened + 1
    server.start()
    engine.until_closed(lambda n: engine.fetch(3000 + n))
    assert engine.fetch(0) is HIT  # found by its check, and promoted


def test_a_full_disk_refuses_writes_and_keeps_serving_promotions(tmp_path: Path) -> None:
    from tiers.file import BlockFileTier

    tier = BlockFileTier(namespace=NAMESPACE, name="nvme", path=tmp_path / "nvme", min_free=0)
    engine = Engine(tier)
    try:
        for i in range(8):
            engine.store(i)
        assert engine.figures()["demotions"] == 8
        stat = os.statvfs(tmp_path)
        tier.min_free = stat.f_bavail * stat.f_frsize + (1 << 30)  # the disk is full
        for i in range(8, 8 + FAILURES):  # evicts 0-2 from the primary
            engine.store(i)
        figures = engine.figures()
        assert figures["write_breaker"] == "open" and figures["breaker"] == "closed"
        assert figures["demotion_failures"] == FAILURES
        calls = engine.calls()
        engine.store(20)
        assert engine.calls() == calls and engine.figures()["write_breaker_refused"] == 1
        assert engine.refusal_seconds(demotion(engine, 21)) < REFUSAL_BOUND
        assert engine.manager.pool.lookup(k(0)) is MISS
        assert engine.fetch(0) is HIT  # promoted from the full disk
        assert int(engine.memory[engine.manager.pool.slot(k(0))][0]) == 0
        time.sleep(COOLDOWN)
        engine.store(22)  # the write probe: still full
        assert engine.figures()["write_breaker_opened"] == 2
        tier.min_free = 0  # space freed
        probes = engine.until_closed(lambda n: engine.store(100 + n), "write_breaker")
        assert probes == 1 and tier.knows(k(101))
        assert engine.figures()["breaker_opened"] == 0
    finally:
        engine.close()


@pytest.mark.redis
def test_replay_against_a_dead_redis_ends_with_the_breaker_open(tmp_path: Path) -> None:
    dead = RedisServer(tmp_path / "redis")  # its port, never started
    config = Config(
        tiers=(
            TierConfig(
                name="redis",
                type="redis",
                write="through",
                options={"url": dead.url, "connect_timeout": 0.2},
            ),
        ),
        faults=FaultsConfig(timeout=0.5, breaker=BreakerConfig(failures=5, cooldown=30.0)),
    )
    requests = [TraceRequest(tuple(range(i, i + 4)), 2048) for i in range(40)]
    result = replay_tiered(requests, config, capacity=16)
    assert result.breakers == {"redis": "open"}
    figures = result.stats["tiers"]["redis"]
    assert figures["demotion_failures"] > 0 and figures["breaker_refused"] > 0
    assert figures["breaker_opened"] == 1  # and stayed open: no probe within the cooldown
