"""The manager's test harness: a `TieringOffloadingManager` over slots in a numpy array and
memory tiers, on a real runtime, driven through vLLM's step protocol (test process, the test's
thread as the engine's). Shared by the manager's tests and the tiers' tests through it; the
`make` fixture that builds harnesses is in `tests/tiering/conftest.py`."""

from __future__ import annotations

import time
from typing import Any
from unittest.mock import Mock

import numpy as np

from tiering.config import (
    BreakerConfig,
    Config,
    FaultsConfig,
    MetricsConfig,
    PrimaryConfig,
    PromotionConfig,
    ShutdownConfig,
    TierConfig,
)
from tiering.keys import BlockKey, make_key
from tiering.manager import TieringOffloadingManager, close_tiers
from tiering.primary import LookupResult, PrimaryPool
from tiering.runtime import Runtime
from tiering.stepping import StepDriver
from tiering.testing import NAMESPACE
from tiering.tier import Tier
from tiers.memory import MemoryTier

BLOCK = 4096
HIT, PENDING, MISS, RETRY = (
    LookupResult.HIT,
    LookupResult.PENDING,
    LookupResult.MISS,
    LookupResult.RETRY,
)


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class Harness:
    """A manager over `slots` slots of BLOCK bytes in a numpy array, and its tiers, driven
    through vLLM's step protocol (`tiering.stepping.StepDriver`)."""

    def __init__(self, tiers: list[tuple[TierConfig, Tier]], slots: int = 8, **kw: Any) -> None:
        self.memory = np.zeros((slots, BLOCK), dtype=np.uint8)
        gate = kw.pop("gate", "always")
        config = Config(
            tiers=tuple(cfg for cfg, _ in tiers),
            promotion=PromotionConfig(
                deadline=kw.pop("promotion_deadline", 2.0),
                gate=gate,
                prefill_rate=kw.pop("prefill_rate", 20_000.0),
            ),
            faults=FaultsConfig(
                timeout=kw.pop("timeout", 2.0), breaker=BreakerConfig(failures=100)
            ),
            shutdown=kw.pop("shutdown", ShutdownConfig()),
            primary=kw.pop("primary", PrimaryConfig()),
            metrics=kw.pop("metrics", MetricsConfig()),
        )
        self.runtime = Runtime(config.faults.breaker)
        self.tiers = tiers
        self.manager = TieringOffloadingManager(
            PrimaryPool(slots, "lru", events=True),
            tiers,
            lambda s: memoryview(self.memory[s]),
            config=config,
            runtime=self.runtime,
            block_tokens=32,
            **kw,
        )
        self.driver = StepDriver(self.manager, fill=self.fill)

    def fill(self, key: BlockKey, slot: int) -> None:
        self.memory[slot] = int.from_bytes(key[:4], "big") % 251 + 1  # the "KV" of a block

    def settle(self, steps: int = 3) -> None:
        """Run engine steps until the runtime is idle."""
        self.driver.settle(steps)

    def end_step(self) -> None:
        """End the step and give the runtime the time between steps (for its bookkeeping and
        the jobs it starts)."""
        self.driver.step()

    def store(self, *ids: int) -> None:
        assert self.driver.store([k(i) for i in ids]) is not None

    def demote_and_forget(self, *ids: int) -> None:
        """Store blocks, let the tiers take them, and reset: the primary forgets them."""
        self.store(*ids)
        self.settle()
        self.manager.reset()

    def block(self, i: int) -> bytes:
        return bytes([int.from_bytes(k(i)[:4], "big") % 251 + 1]) * BLOCK

    def slot_bytes(self, i: int) -> bytes:
        return bytes(self.memory[self.manager.pool.slot(k(i))])

    def lookup_until(self, i: int, want: LookupResult) -> list[LookupResult]:
        seen = self.driver.lookup_until(k(i), (want,), between=lambda: self.settle(1))
        if seen[-1] is not want:
            raise AssertionError(f"lookup of {i} never answered {want}: {seen}")
        return seen

    def close(self) -> None:
        """Shut the manager down, then close what the harness opened: the tiers, the runtime."""
        self.manager.shutdown()
        close_tiers(self.runtime, self.tiers)
        self.runtime.shutdown()


async def hog(seconds: float) -> None:
    """Block the runtime's thread (its loop) for `seconds`."""
    time.sleep(seconds)


class UnindexedMemoryTier(MemoryTier):
    """A memory tier that does not tell what it holds, like Redis or S3: the manager must ask
    it with existence checks on the runtime."""

    indexed = False

    def _knows(self, key: BlockKey) -> None:
        return None


def memory_tier(
    name: str = "mem", write: str = "through", indexed: bool = False, **cfg: Any
) -> tuple[TierConfig, MemoryTier]:
    tier = (MemoryTier if indexed else UnindexedMemoryTier)(namespace=NAMESPACE, name=name)
    return TierConfig(name=name, type="memory", write=write, **cfg), tier


def spied(inner: MemoryTier) -> Any:
    """`inner` behind a `Mock(wraps=...)` that counts its calls and keeps its attributes."""
    tier = Mock(wraps=inner)
    tier.counters, tier.indexed, tier.knows = inner.counters, inner.indexed, inner.knows
    return tier
