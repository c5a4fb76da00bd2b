"""The forwarding base (through the conformance suite) and the fault injector."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.tiers.memory_hooks import WriteOnceMemoryTier, plant, stored
from tiering.errors import TierTimeout, TierUnavailable
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE, key, payload
from tiering.testing.tier import MakeTier, StoreDown, TierConformance
from tiering.tier import Medium, Tier
from tiering.tier.contract import CAPABILITIES, TierContract
from tiering.tier.wrappers import FaultyTier, ForwardingTier
from tiers.memory import MemoryTier


class TestForwardingTier(TierConformance):
    @pytest.fixture
    def make_tier(self) -> MakeTier:
        def make(**options: Any) -> Tier:
            return ForwardingTier(MemoryTier(**{"namespace": NAMESPACE, **options}))

        return make

    @pytest.fixture
    def store_down(self) -> StoreDown:
        pytest.skip("memory: the store is the tier's own dict, which cannot go down")

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        assert isinstance(tier, ForwardingTier)
        plant(tier.inner, key, blob)

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        assert isinstance(tier, ForwardingTier)
        return stored(tier.inner, key)


def faulty(**faults: Any) -> FaultyTier:
    return FaultyTier(MemoryTier(namespace=NAMESPACE), seed=1, **faults)


def test_injected_corruption_is_caught_by_verification() -> None:
    async def body() -> None:
        tier = faulty(corrupt=1.0)
        await tier.put(key(1), payload(10_000, 1))
        assert await tier.get(key(1), bytearray(10_000)) is False
        reasons = [k for k in tier.counters if k.startswith("corrupt.")]
        assert reasons and tier.injected["corrupt"] == 1
        assert stored(tier.inner, key(1)) is None
        assert await tier.contains([key(1)]) == [False]  # deleted as refused

    asyncio.run(body())


def test_injected_failures_raise_unavailable() -> None:
    async def body() -> None:
        tier = faulty(fail=1.0)
        for call in (
            tier.put(key(1), b"x"),
            tier.get(key(1), bytearray(1)),
            tier.contains([key(1)]),
        ):
            with pytest.raises(TierUnavailable, match="injected"):
                await call
        tier.fail = 0.0
        await tier.put(key(1), b"x")  # recovers as soon as the fault goes
        assert tier.counters["errors"] == 3

    asyncio.run(body())


def test_injected_delay_hits_the_deadline() -> None:
    async def body() -> None:
        tier = faulty(delay=1.0, delay_seconds=10.0, timeout=0.2)
        start = time.monotonic()
        with pytest.raises(TierTimeout, match="no answer within 0.2s"):
            await tier.get(key(1), bytearray(1))
        assert time.monotonic() - start < 1.0

    asyncio.run(body())


def test_dropped_writes_are_misses_later() -> None:
    async def body() -> None:
        tier = faulty(drop=1.0)
        await tier.put(key(1), b"lost")
        tier.drop = 0.0
        assert await tier.get_bytes(key(1), 4) is None

    asyncio.run(body())


def test_batches_report_failures_in_place() -> None:
    async def body() -> None:
        tier = FaultyTier(MemoryTier(namespace=NAMESPACE), fail=0.5, seed=3)
        results = await tier.put_many([(key(i), b"v") for i in range(40)])
        failed = [r for r in results if isinstance(r, TierUnavailable)]
        assert 5 < len(failed) < 35 and len(failed) == tier.injected["fail"]
        assert all(r is None or isinstance(r, TierUnavailable) for r in results)

    asyncio.run(body())


def test_a_cancelled_batch_leaves_no_call_unstarted_and_unawaited() -> None:
    """Calls still queued behind the concurrency bound when a batch is cancelled (a deadline,
    shutdown) are closed, not left to warn "coroutine was never awaited" at collection."""
    import gc
    import warnings

    tier = FaultyTier(MemoryTier(namespace=NAMESPACE), concurrency=1, delay=1.0, delay_seconds=5)

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(tier.get_many([(key(i), bytearray(8)) for i in range(4)]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(cancel_midway())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_a_wrapped_tier_keeps_its_medium() -> None:
    inner = MemoryTier(namespace=NAMESPACE, name="m")
    assert inner.medium == "memory"
    assert FaultyTier(inner).medium == "memory"  # its hits are the host's, not a remote's


def test_a_wrapper_passes_on_what_the_store_said_of_a_write() -> None:
    """A write-once backend's False (the store held the key: nothing written) reaches the
    base through the wrapper, so a wrapped tier counts its duplicates; its usage is its
    store's."""

    async def body() -> None:
        async with FaultyTier(WriteOnceMemoryTier(namespace=NAMESPACE)) as tier:
            await tier.put(key(1), payload(100))
            await tier.put(key(1), payload(100))
            assert tier.counters["duplicates"] == 1
            (usage,) = await tier.usage()
            assert usage.objects == 1

    asyncio.run(body())


def test_a_wrapper_takes_every_capability_and_writes_at_its_alignment() -> None:
    """Capabilities are the wrapped tier's, whatever it declares (here set on the instance),
    and the wrapper's objects are laid out at the wrapped tier's alignment."""
    inner = MemoryTier(namespace=NAMESPACE)
    inner.persistent, inner.shared, inner.align, inner.indexed = True, True, 4096, False
    inner.writes_once = True
    wrapper = ForwardingTier(inner)
    for name in CAPABILITIES:
        assert getattr(wrapper, name) == getattr(inner, name), name
    declared = {
        name
        for name, value in vars(TierContract).items()
        if not name.startswith("_") and isinstance(value, str | bool | int | Medium)
    }
    assert declared == set(CAPABILITIES)  # every value the contract declares, listed once
    asyncio.run(wrapper.put(key(1), payload(100)))
    blob = stored(inner, key(1))
    assert blob is not None and int.from_bytes(blob[14:18], "little") == 4096


class _DictTier(Tier):
    """A library user's indexed backend: it answers `_knows` from its dict and nothing of
    refusals."""

    type_name = "dict-test"
    indexed = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.objects: dict[BlockKey, bytes] = {}

    def _knows(self, key: BlockKey) -> bool | None:
        return key in self.objects

    async def _read(self, key: BlockKey, limit: int) -> bytes | None:
        return self.objects.get(key)

    async def _write(self, key: BlockKey, parts: Any) -> bool:
        self.objects[key] = b"".join(parts)
        return True

    async def _delete(self, key: BlockKey) -> bool:
        return self.objects.pop(key, None) is not None

    async def _contains(self, keys: Any) -> list[bool]:
        return [k in self.objects for k in keys]

    async def _stat(self) -> Any:
        raise NotImplementedError


@pytest.mark.parametrize("wrapped", [False, True])
def test_every_indexed_tier_says_no_for_a_key_it_refused_moments_ago(wrapped: bool) -> None:
    """A backend that answers only `_knows` (and a wrapper over it) says no for a key refused
    and left in place moments ago, from the base alone: the manager then promotes the block
    from another tier rather than read the refused object again."""

    async def body() -> None:
        inner = _DictTier(namespace=NAMESPACE, read_only=True)
        tier: Tier = ForwardingTier(inner) if wrapped else inner
        inner.objects[key(1)] = b"not a kvtier object"
        inner.objects[key(2)] = b"not one either"
        assert tier.knows(key(1)) is True
        assert not await tier.get(key(1), bytearray(64))  # refused, left (read-only)
        assert tier.knows(key(1)) is False and tier.knows(key(2)) is True

    asyncio.run(body())
