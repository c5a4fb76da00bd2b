"""A manager over one real tier, driven as vLLM does, to test its circuit breakers (test process,
the test's thread as the engine's): the breakers' tests over servers that stop, and the Redis
bounds tests' full server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tiering.config import BreakerConfig, Config, FaultsConfig, PromotionConfig, TierConfig
from tiering.keys import BlockKey, make_key
from tiering.manager import TieringOffloadingManager, close_tiers
from tiering.primary import LookupResult, PrimaryPool
from tiering.runtime import Job, Runtime
from tiering.stepping import StepDriver
from tiering.tier import Tier

BLOCK = 16 << 10
COOLDOWN = 0.3
FAILURES = 3
REFUSAL_BOUND = 0.005  # seconds: a refused job reports within this, with no call to the tier
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class Engine:
    """A manager over one tier and `slots` primary slots of numpy memory, driven as vLLM does."""

    def __init__(self, tier: Tier, slots: int = 8) -> None:
        self.tier = tier
        self.name = tier.name
        self.memory = np.zeros((slots, BLOCK), dtype=np.uint8)
        cfg = TierConfig(name=tier.name, type=tier.type_name, write="through")
        config = Config(
            tiers=(cfg,),
            promotion=PromotionConfig(deadline=2.0, gate="always"),
            faults=FaultsConfig(
                timeout=1.0, breaker=BreakerConfig(failures=FAILURES, cooldown=COOLDOWN)
            ),
        )
        self.runtime = Runtime(config.faults.breaker)
        self.tiers = [(cfg, tier)]
        self.manager = TieringOffloadingManager(
            PrimaryPool(slots, "lru"),
            self.tiers,
            lambda s: memoryview(self.memory[s]),
            config=config,
            runtime=self.runtime,
            block_tokens=16,
        )
        self.driver = StepDriver(self.manager, fill=self.fill, idle_timeout=10, poll=0.002)

    def fill(self, key: BlockKey, slot: int) -> None:
        self.memory[slot] = key[31] % 251  # block i's bytes are i (every i here is below 251)

    def step(self) -> None:
        """End a step and let the runtime finish the jobs it queued."""
        self.driver.step()
        self.driver.end_step()

    def store(self, i: int) -> None:
        """Store block `i` (its write-through demotion starts at the step's end) and step."""
        assert self.driver.store([k(i)]) is not None
        self.step()

    def fetch(self, i: int) -> LookupResult:
        """Look block `i` up, stepping until the answer settles (HIT or MISS)."""
        seen = self.driver.lookup_until(k(i), (HIT, MISS), between=self.step)
        if seen[-1] not in (HIT, MISS):
            raise AssertionError(f"the lookup of {i} never settled: {seen[-1]}")
        return seen[-1]

    def figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = self.manager.stats()["tiers"][self.name]
        return figures

    def calls(self) -> int:
        """Everything the tier counted (each call to it counts something: a hit, a miss, a
        put, an error)."""
        return sum(self.tier.counters.values())

    def refusal_seconds(self, job: Job) -> float:
        """How long the runtime takes to report `job` refused (it must be), with no call to the
        tier."""
        calls = self.calls()
        start = time.perf_counter()
        self.runtime.submit(job)
        results = self.runtime.poll()
        seconds = time.perf_counter() - start
        assert len(results) == 1 and not results[0].ok, results
        assert "circuit breaker open" in str(results[0].error)
        assert self.calls() == calls
        return seconds

    def until_closed(self, traffic: Callable[[int], object], breaker: str = "breaker") -> int:
        """Run `traffic(n)` (one job for the tier each) until the breaker closes; the number of
        probes it took. The server is back: within a few cooldowns (a client may lose one call
        to a connection from before the restart)."""
        for n in range(1, 11):
            time.sleep(COOLDOWN)
            traffic(n)
            if self.figures()[breaker] == "closed":
                return n
        raise AssertionError(f"the {breaker} of {self.name} never closed: {self.figures()}")

    def close(self) -> None:
        self.manager.shutdown()
        close_tiers(self.runtime, self.tiers)
        self.runtime.shutdown()
