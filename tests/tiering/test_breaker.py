"""The runtime's circuit breakers over batch jobs of real tiers (`FaultyTier` for the faults): a
batch whose items failed counts as a failure, a corrupt item never does, a full tier opens only
its write breaker, and a half-open breaker lets exactly one job through."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tiering.breaker import fault_of
from tiering.config import BreakerConfig
from tiering.errors import CorruptObject, TierFull, TierUnavailable
from tiering.keys import BlockKey, make_key
from tiering.runtime import Job, JobResult, Runtime
from tiering.testing import NAMESPACE
from tiering.tier.wrappers import FaultyTier
from tiers.memory import MemoryTier

BLOCK = 4096
COOLDOWN = 0.3


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


def wait_for(runtime: Runtime, n: int, timeout: float = 5.0) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results += runtime.poll()
        time.sleep(0.002)
    assert len(results) == n, f"{len(results)} of {n} jobs reported"
    return results


@pytest.fixture
def runtime() -> Any:
    rt = Runtime(BreakerConfig(failures=3, cooldown=COOLDOWN))
    yield rt
    rt.shutdown()


def puts(tier: Any, first: int, n: int = 4) -> Job:
    items = [(k(i), bytes(BLOCK)) for i in range(first, first + n)]
    return Job(tier.name, lambda: tier.put_many(items), 2.0, writes=True)


def gets(tier: Any, first: int, n: int = 4) -> Job:
    items = [(k(i), bytearray(BLOCK)) for i in range(first, first + n)]
    return Job(tier.name, lambda: tier.get_many(items), 2.0)


def test_a_batch_with_failed_items_is_a_breaker_failure_its_items_unchanged(
    runtime: Runtime,
) -> None:
    tier = FaultyTier(MemoryTier(namespace=NAMESPACE, name="mem"), fail=1.0)
    runtime.submit_many([puts(tier, 0), gets(tier, 0), puts(tier, 8)])
    results = wait_for(runtime, 3)
    for result in results:  # the items reach the submitter as before: ok, errors in place
        assert result.ok and len(result.value) == 4
        assert all(isinstance(item, TierUnavailable) for item in result.value)
        assert isinstance(result.fault, TierUnavailable)
    assert runtime.breaker_state("mem") == "open"
    assert runtime.write_breaker("mem").failures == 2  # two of the three jobs wrote


def test_corrupt_items_and_a_few_lost_ones_are_no_breaker_failures(runtime: Runtime) -> None:
    """A corrupt object is the data's fault; one item lost in a batch that the tier otherwise
    served is an error, not a dead tier: neither opens the breaker."""

    async def corrupt_batch() -> list[Any]:
        return [CorruptObject("checksum", "a planted object"), False, True]

    async def mostly_served() -> list[Any]:
        return [TierUnavailable("one connection dropped"), True, True, False]

    for batch in [corrupt_batch, mostly_served] * 3:
        runtime.submit(Job("mem", batch, 1.0))
    results = wait_for(runtime, 6)
    assert all(r.ok and r.fault is None for r in results)
    assert runtime.breaker_state("mem") == "closed"
    down, full = TierUnavailable("down"), TierFull("full")
    assert fault_of([CorruptObject("length", "x"), full]) is full  # half faulted: full
    assert fault_of([full, down, None, None]) is full  # half faulted, a quarter down
    assert fault_of([down, full, down, None]) is down
    assert fault_of([down, None, None]) is None
    assert fault_of([]) is None and fault_of("not a batch") is None


def test_a_full_tier_refuses_writes_and_keeps_serving_reads(runtime: Runtime) -> None:
    # A memory tier of 1 KiB holds none of these 4 KiB blocks: every put is TierFull.
    inner = MemoryTier(namespace=NAMESPACE, name="mem")
    asyncio.run(inner.put(k(100), bytes(BLOCK)))  # stored while there was room
    inner.capacity = 1024
    runtime.submit_many([puts(inner, 0) for _ in range(3)])
    assert all(isinstance(r.fault, TierFull) for r in wait_for(runtime, 3))
    assert runtime.write_breaker("mem").state == "open"
    assert runtime.breaker_state("mem") == "closed"  # a full tier still answers
    calls = sum(inner.counters.values())
    start = time.monotonic()
    runtime.submit(puts(inner, 0))
    (refused,) = wait_for(runtime, 1)
    assert time.monotonic() - start < 0.005
    assert not refused.ok and isinstance(refused.error, TierFull)
    assert "writes to tier 'mem': circuit breaker open" in str(refused.error)
    assert sum(inner.counters.values()) == calls  # refused without calling the tier
    runtime.submit(gets(inner, 100, 1))  # reads go on
    (read,) = wait_for(runtime, 1)
    assert read.ok and read.value == [True]
    time.sleep(COOLDOWN)
    inner.capacity = None  # room again: the write probe succeeds and closes it
    runtime.submit(puts(inner, 0))
    (probe,) = wait_for(runtime, 1)
    assert probe.ok and probe.fault is None
    assert runtime.write_breaker("mem").state == "closed"


def test_a_half_open_breaker_lets_exactly_one_job_through(runtime: Runtime) -> None:
    tier = FaultyTier(MemoryTier(namespace=NAMESPACE, name="mem"), fail=1.0)
    runtime.submit_many([gets(tier, 0) for _ in range(3)])
    wait_for(runtime, 3)
    assert runtime.breaker_state("mem") == "open"
    time.sleep(COOLDOWN)
    runtime.submit_many([gets(tier, 0) for _ in range(5)])
    results = wait_for(runtime, 5)
    through = [r for r in results if r.ok]
    assert len(through) == 1 and tier.injected["fail"] == 3 * 4 + 4  # one batch of four reads
    assert all("circuit breaker open" in str(r.error) for r in results if not r.ok)
    assert runtime.breaker_state("mem") == "open" and runtime.breaker("mem").opened == 2
    time.sleep(COOLDOWN)
    tier.fail = 0.0  # the server is back
    runtime.submit_many([gets(tier, 0) for _ in range(2)])
    results = wait_for(runtime, 2)
    assert sorted(r.ok and r.fault is None for r in results) == [False, True]
    assert runtime.breaker_state("mem") == "closed"


def test_only_the_probe_moves_an_open_breaker(runtime: Runtime) -> None:
    """A job admitted before the breaker opened that ends later (a slow success) does not close
    it: the probe after the cooldown decides."""
    tier = FaultyTier(MemoryTier(namespace=NAMESPACE, name="mem"), fail=1.0)

    async def slow_success() -> list[bool]:
        await asyncio.sleep(0.15)
        return [False]

    runtime.submit(Job("mem", slow_success, 2.0))
    runtime.submit_many([gets(tier, 0) for _ in range(3)])
    results = wait_for(runtime, 4)
    assert [r.fault is None for r in results] == [False, False, False, True]
    assert runtime.breaker_state("mem") == "open"  # the late success changed nothing


def test_a_write_refused_by_its_breaker_leaves_the_probe_to_a_read(runtime: Runtime) -> None:
    tier = FaultyTier(MemoryTier(namespace=NAMESPACE, name="mem"), fail=1.0)
    runtime.submit_many([puts(tier, 0) for _ in range(3)])  # opens both breakers
    wait_for(runtime, 3)
    writes = runtime.write_breaker("mem")
    writes.opened_at += 60.0  # the write breaker stays open; the tier's cools down
    time.sleep(COOLDOWN)
    tier.fail = 0.0
    runtime.submit(puts(tier, 0))  # refused by the write breaker: no probe taken
    runtime.submit(gets(tier, 0))  # the tier's probe
    refused, probe = sorted(wait_for(runtime, 2), key=lambda r: r.job_id)
    assert not refused.ok and "writes to tier 'mem'" in str(refused.error)
    assert probe.ok and runtime.breaker_state("mem") == "closed" and writes.state == "open"
