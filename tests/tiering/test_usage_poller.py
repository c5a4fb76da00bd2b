"""The tiers' store-wide usage in the manager's snapshot (`tiering.manager.usage`), polled in
the background over a real file tier, and the blocks loaded that another engine stored."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.manager import HIT, Harness, k
from tiering.config import MetricsConfig, TierConfig, parse_config
from tiering.errors import ConfigError, TierUnavailable
from tiering.metrics import render
from tiering.testing import NAMESPACE
from tiering.tier import NamespaceUsage
from tiers.file import BlockFileTier
from tiers.memory import MemoryTier

BLOCK = 4096
OTHER = bytes(range(100, 116))
"""Another model's namespace, stored in the same directory by another engine."""


def block(i: int) -> bytes:
    """The bytes the harness's engine "computes" for block `i` (`Harness.fill`)."""
    return bytes([int.from_bytes(k(i)[:4], "big") % 251 + 1]) * BLOCK


def written_by_another_engine(path: Path, namespace: bytes, keys: range) -> None:
    async def go() -> None:
        async with BlockFileTier(namespace=namespace, path=path, min_free=0) as tier:
            await tier.put_many([(k(i), block(i)) for i in keys])

    asyncio.run(go())


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)


def file_state(tmp_path: Path, capacity: int | None = 1 << 30) -> tuple[TierConfig, BlockFileTier]:
    tier = BlockFileTier(
        namespace=NAMESPACE, path=tmp_path / "nvme", min_free=0, name="nvme", capacity=capacity
    )
    return TierConfig(name="nvme", type="file", write="through", capacity=capacity), tier


def test_the_snapshot_has_the_store_wide_usage_after_a_poll(
    tmp_path: Path, make: Callable[..., Harness]
) -> None:
    written_by_another_engine(tmp_path / "nvme", OTHER, range(100, 103))
    h = make([file_state(tmp_path)], metrics=MetricsConfig(usage_interval=0.2))
    h.store(1, 2)
    h.settle()
    polls = h.manager.usage.polls
    until(lambda: h.manager.usage.polls > polls + 1)  # one that began after the store
    row = h.manager.snapshot()["tiers"]["nvme"]
    total = sum(p.stat().st_size for p in (tmp_path / "nvme").glob("*/*/*/*.kv"))
    assert (row["usage_objects"], row["usage_namespaces"], row["usage_own_objects"]) == (5, 2, 2)
    assert row["usage_bytes"] == total and row["usage_own_bytes"] == total * 2 // 5
    assert row["capacity_bytes"] == 1 << 30 and row["usage_failures"] == 0
    assert h.manager.stats()["tiers"]["nvme"]["usage_objects"] == 5
    text = render(h.manager.snapshot())
    assert 'kvtier_tier_usage_objects{tier="nvme"} 5.0' in text
    assert 'kvtier_tier_capacity_bytes{tier="nvme"} 1073741824.0' in text


class FailingUsage(MemoryTier):
    """A memory tier whose store-wide listing fails or hangs on demand (its data path works)."""

    fail = False
    hang = 0.0

    async def _usage(self) -> list[NamespaceUsage]:
        if self.hang:
            await asyncio.sleep(self.hang)
        if self.fail:
            raise TierUnavailable("the listing is refused")
        return await super()._usage()


def test_a_failing_or_hanging_usage_call_changes_nothing_else(
    make: Callable[..., Harness],
) -> None:
    tier = FailingUsage(namespace=NAMESPACE, name="mem")
    h = make(
        [(TierConfig(name="mem", type="memory", write="through"), tier)],
        metrics=MetricsConfig(usage_interval=0.2),
    )
    h.store(1, 2, 3)
    h.settle()
    until(lambda: h.manager.snapshot()["tiers"]["mem"].get("usage_objects") == 3)
    tier.fail = True
    until(lambda: h.manager.snapshot()["tiers"]["mem"]["usage_failures"] >= 6)
    tier.fail, tier.hang = False, 5.0  # past its deadline (one interval): a failure too
    failures = h.manager.snapshot()["tiers"]["mem"]["usage_failures"]
    for _ in range(20):  # while listings hang, the engine has nothing to wait for
        assert not h.manager.has_pending_work()
        time.sleep(0.02)
    until(lambda: h.manager.snapshot()["tiers"]["mem"]["usage_failures"] > failures)
    row = h.manager.snapshot()["tiers"]["mem"]
    assert row["usage_objects"] == 3  # the last figures stay
    assert (row["breaker"], row["breaker_opened"], row["breaker_refused"]) == ("closed", 0, 0)
    assert row["errors"] == 0 and tier.counters["errors"] == 0
    h.manager.reset()  # the primary forgets: the tier serves the blocks as before
    assert h.lookup_until(2, HIT)[-1] is HIT and h.slot_bytes(2) == h.block(2)


def test_usage_interval_0_lists_nothing(tmp_path: Path, make: Callable[..., Harness]) -> None:
    cfg, tier = file_state(tmp_path)
    calls: list[float | None] = []
    listing = tier.usage

    async def counted(timeout: float | None = None) -> list[NamespaceUsage]:
        calls.append(timeout)
        return await listing(timeout)

    tier.usage = counted  # type: ignore[method-assign]
    h = make([(cfg, tier)], metrics=MetricsConfig(usage_interval=0))
    h.store(1)
    h.settle()
    time.sleep(0.1)
    row = h.manager.snapshot()["tiers"]["nvme"]
    assert calls == [] and "usage_objects" not in row and row["usage_failures"] == 0


def test_usage_interval_is_a_duration_of_30s_by_default() -> None:
    assert parse_config({}).metrics.usage_interval == 30.0
    assert parse_config({"metrics": {"usage_interval": "2m"}}).metrics.usage_interval == 120.0
    assert parse_config({"metrics": {"usage_interval": 0}}).metrics.usage_interval == 0.0
    with pytest.raises(ConfigError, match="metrics.usage_interval: expected a duration"):
        parse_config({"metrics": {"usage_interval": "often"}})


def test_blocks_another_engine_stored_are_counted_per_tier(
    tmp_path: Path, make: Callable[..., Harness]
) -> None:
    written_by_another_engine(tmp_path / "nvme", NAMESPACE, range(1, 4))
    h = make([file_state(tmp_path)], metrics=MetricsConfig(usage_interval=0))
    for i in (1, 2, 3):
        h.lookup_until(i, HIT)
        assert h.slot_bytes(i) == block(i)
    h.store(9)  # this engine's own block, written through and read back: not another's
    h.settle()
    h.manager.reset()
    h.lookup_until(9, HIT)
    row = h.manager.snapshot()["tiers"]["nvme"]
    assert row["hits_other_writer"] == 3 and row["tier.hits"] == 4
