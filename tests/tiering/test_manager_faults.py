"""The manager over real servers that die mid-run: calls facing the engine never raise, return
within a step's budget, and the tier is used again once its server is back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.servers import RedisServer, SeaweedS3
from tiering.config import BreakerConfig, Config, FaultsConfig, PromotionConfig, TierConfig
from tiering.keys import BlockKey, make_key
from tiering.manager import TieringOffloadingManager, close_tiers
from tiering.primary import LookupResult, PrimaryPool
from tiering.runtime import Runtime
from tiering.stepping import StepDriver
from tiering.testing import NAMESPACE
from tiering.tier import Tier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

BLOCK = 16 << 10
STEP_BUDGET = 0.05  # seconds: what one engine step may spend in the manager


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class Engine:
    """Drives a manager the way vLLM's connector does (`StepDriver`), timing every call."""

    def __init__(self, cfg: TierConfig, tier: Tier) -> None:
        self.memory = np.zeros((32, BLOCK), dtype=np.uint8)
        config = Config(
            tiers=(cfg,),
            promotion=PromotionConfig(deadline=1.0, gate="always"),
            faults=FaultsConfig(timeout=1.0, breaker=BreakerConfig(failures=3, cooldown=0.5)),
        )
        self.runtime = Runtime(config.faults.breaker)
        self.tiers = [(cfg, tier)]
        self.manager = TieringOffloadingManager(
            PrimaryPool(32, "lru"),
            self.tiers,
            lambda s: memoryview(self.memory[s]),
            config=config,
            runtime=self.runtime,
            block_tokens=16,
        )
        self.driver = StepDriver(self.manager, fill=self.fill)  # its calls must not raise

    def fill(self, key: BlockKey, slot: int) -> None:
        self.memory[slot] = key[31]

    def close(self) -> None:
        """Shut the manager down, then close what this engine opened."""
        self.manager.shutdown()
        close_tiers(self.runtime, self.tiers)
        self.runtime.shutdown()

    @property
    def slowest(self) -> float:
        return self.driver.slowest

    def store(self, ids: range) -> None:
        self.driver.store([k(i) for i in ids])

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.driver.end_step()
            time.sleep(0.02)

    def fetch(self, i: int, steps: int = 150) -> LookupResult:
        """Look a block up until the answer settles (HIT or MISS)."""
        return self.driver.lookup_until(k(i), steps=steps, between=self.step)[-1]

    def forget(self) -> None:
        start = time.monotonic()
        self.manager.reset()  # must not raise
        self.driver.slowest = max(self.driver.slowest, time.monotonic() - start)


def exercise(engine: Engine, stop: Any, start: Any) -> None:
    engine.store(range(0, 8))
    engine.step(10)
    engine.forget()  # the primary forgets; the blocks are in the tier
    assert engine.fetch(1) is LookupResult.HIT
    stop()
    engine.forget()
    for i in range(8, 16):  # stores keep working; demotions fail and are counted
        engine.store(range(i, i + 1))
        engine.step()
    assert engine.fetch(2) is LookupResult.MISS  # the tier is down: a miss, not an error
    start()
    engine.forget()
    name = engine.manager.tiers[0].config.name
    for i in range(100, 110):  # after the cooldown, checks probe (a client may lose one call
        time.sleep(0.6)  # to a connection from before the restart) until the breaker closes
        engine.fetch(i)
        if engine.runtime.breaker_state(name) == "closed":
            break
    assert engine.runtime.breaker_state(name) == "closed"
    assert engine.fetch(3) is LookupResult.HIT  # back: found again (acknowledged before)
    assert engine.memory[engine.manager.pool.slot(k(3))][0] == k(3)[31]
    assert engine.slowest < STEP_BUDGET, f"a call took {engine.slowest:.3f}s"
    stats = engine.manager.stats()["tiers"]
    (figures,) = stats.values()
    assert figures["errors"] > 0 and figures["promotions"] >= 2
    engine.close()


@pytest.mark.redis
def test_redis_killed_and_restarted(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", durable=True)
    server.start()
    try:
        tier = RedisTier(
            namespace=NAMESPACE, url=server.url, socket_timeout=0.5, connect_timeout=0.5
        )
        engine = Engine(TierConfig(name="redis", type="redis", write="through"), tier)
        exercise(engine, server.stop, server.start)
    finally:
        server.stop()


@pytest.mark.s3
def test_s3_stopped_and_restarted(tmp_path: Path) -> None:
    server = SeaweedS3(tmp_path / "seaweed")
    server.start()
    try:
        tier = S3Tier(
            namespace=NAMESPACE,
            bucket=server.bucket,
            endpoint_url=server.endpoint,
            access_key=server.ACCESS_KEY,
            secret_key=server.SECRET_KEY,
            retries=1,
            connect_timeout=0.3,
            read_timeout=1.0,
        )
        engine = Engine(TierConfig(name="s3", type="s3", write="through"), tier)
        exercise(engine, server.stop, server.start)
    finally:
        server.stop()
