"""The conformance suite's contract tests (pytest): round trips, batches, read-only mode,
concurrency, capabilities, and random calls against a dict model.

`ContractTests` is one of the sections `tiering.testing.tier.TierConformance` is made of; a
backend's test class subclasses `TierConformance`, not this.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tiering.errors import KeyFormatError, StateError, TierFull
from tiering.testing.data import key, payload
from tiering.testing.hooks import MakeTier, TierHooks, asynctest
from tiering.testing.stateful import TierStateMachine

__all__ = ["ContractTests"]


class ContractTests(TierHooks):
    """What every tier does with honest objects (test process, each test on its own
    `asyncio.run` loop); tests of capabilities a tier does not declare skip with the reason."""

    # -- round trips ----------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4095, 4096, 65539, 2 << 20, 8 << 20])
    @asynctest
    async def test_round_trip(self, make_tier: MakeTier, size: int) -> None:
        async with make_tier() as tier:
            data = payload(size, seed=size)
            await tier.put(key(size), data)
            into = bytearray(size)
            assert await tier.get(key(size), into) is True
            assert into == data
            assert tier.counters["hits"] == 1

    @asynctest
    async def test_round_trip_into_a_memoryview_slice(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            data = payload(8192, seed=3)
            await tier.put(key(1), memoryview(data))
            region = bytearray(3 * 8192)
            assert await tier.get(key(1), memoryview(region)[8192:16384])
            assert region[8192:16384] == data and not any(region[:8192])

    @asynctest
    async def test_compressed_codecs(self, make_tier: MakeTier) -> None:
        for codec in ("lz4", "zstd"):
            async with make_tier(codec=codec) as tier:
                data = bytes(100_000)  # compresses well
                await tier.put(key(7), data)
                assert await tier.get_bytes(key(7), len(data)) == data
                stored = await self.raw_get(tier, key(7))
                assert stored is not None and len(stored) < 10_000

    @asynctest
    async def test_miss_is_a_miss(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            into = bytearray(b"untouched")
            assert await tier.get(key(404), into) is False
            assert into == b"untouched"
            assert tier.counters["misses"] == 1 and not any(
                k.startswith("corrupt") for k in tier.counters
            )

    @asynctest
    async def test_overwrite(self, make_tier: MakeTier) -> None:
        """A second put of a key replaces the object, or, on a tier that `writes_once`, leaves
        the first in place and counts a duplicate (engines of one namespace store the same
        bytes for a key: the first one written serves them all)."""
        async with make_tier() as tier:
            await tier.put(key(1), payload(5000, 1))
            await tier.put(key(1), payload(5000, 2))
            kept = 1 if tier.writes_once else 2
            assert await tier.get_bytes(key(1), 5000) == payload(5000, kept)
            assert tier.counters["duplicates"] == (1 if tier.writes_once else 0)
            assert tier.counters["duplicate_bytes"] == (5000 if tier.writes_once else 0)
            assert (await tier.stat()).objects == 1

    @asynctest
    async def test_delete(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            await tier.put(key(1), b"x" * 100)
            assert await tier.delete(key(1)) is True
            assert await tier.delete(key(1)) is False
            assert await tier.get_bytes(key(1), 100) is None
            assert await self.raw_get(tier, key(1)) is None

    @asynctest
    async def test_contains_is_batched(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            await tier.put_many([(key(i), b"v" * 10) for i in range(0, 20, 2)])
            assert await tier.contains([key(i) for i in range(20)]) == [
                i % 2 == 0 for i in range(20)
            ]
            assert await tier.contains([]) == []

    @asynctest
    async def test_batches(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            results = await tier.put_many([(key(i), payload(3000, i)) for i in range(40)])
            assert results == [None] * 40
            buffers = [bytearray(3000) for _ in range(41)]
            found = await tier.get_many([(key(i), buffers[i]) for i in range(41)])
            assert found == [True] * 40 + [False]
            assert all(buffers[i] == payload(3000, i) for i in range(40))
            assert await tier.delete_many([key(0), key(999)]) == [True, False]

    @asynctest
    async def test_invalid_keys_are_rejected(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            for bad in ("not-hex", "ABCDEF0123456789AB", "../../etc/passwd", "0" * 7):
                with pytest.raises(KeyFormatError):
                    await tier.put(bad, b"x")
                with pytest.raises(KeyFormatError):
                    await tier.get(bad, bytearray(1))
            await tier.put(key(5).hex(), b"by hex")
            assert await tier.get_bytes(key(5), 6) == b"by hex"

    @asynctest
    async def test_capacity_holds_for_batches(self, make_tier: MakeTier) -> None:
        async with make_tier(capacity=1 << 20) as tier:
            if not tier.evicts:
                pytest.skip(f"{tier.type_name}: its server or service enforces its own limits")
            blocks = [(key(i), payload(200_000, i)) for i in range(8)]
            assert await tier.put_many(blocks[:4]) == [None] * 4
            assert await tier.put_many(blocks[4:]) == [None] * 4
            stat = await tier.stat()
            assert stat.bytes_used <= 1 << 20
            assert (await tier.contains([key(i) for i in range(8)]))[4:] == [True] * 4
            too_big = await tier.put_many([(key(20), payload(2 << 20)), blocks[0]])
            assert isinstance(too_big[0], TierFull) and too_big[1] is None

    @asynctest
    async def test_read_only(self, make_tier: MakeTier) -> None:
        async with make_tier() as writer:
            await writer.put(key(1), b"kept")
        async with make_tier(read_only=True) as tier:
            with pytest.raises(StateError, match="read-only"):
                await tier.put(key(2), b"x")
            with pytest.raises(StateError, match="read-only"):
                await tier.delete(key(1))
            await self.raw_put(tier, key(3), b"garbage" * 10)
            assert await tier.get(key(3), bytearray(4)) is False
            assert await self.raw_get(tier, key(3)) is not None  # refused, but not deleted
            if tier.persistent or tier.shared:
                assert await tier.get_bytes(key(1), 4) == b"kept"

    # -- concurrency ------------------------------------------------------------------------------

    @asynctest
    async def test_concurrent_puts_and_gets_never_tear(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            size = 256 << 10
            versions = [payload(size, seed) for seed in range(4)]
            await tier.put(key(1), versions[0])

            async def reader() -> None:
                for _ in range(12):
                    got = await tier.get_bytes(key(1), size)
                    assert got in versions

            async def writer(i: int) -> None:
                for _ in range(6):
                    await tier.put(key(1), versions[i])

            await asyncio.gather(*(reader() for _ in range(3)), *(writer(i) for i in range(4)))
            assert not any(k.startswith("corrupt") for k in tier.counters), tier.counters

    # -- capabilities ---------------------------------------------------------------------------

    @asynctest
    async def test_capacity_evicts_least_recently_used(self, make_tier: MakeTier) -> None:
        async with make_tier(capacity=1 << 20) as tier:
            if not tier.evicts:
                assert (await tier.stat()).capacity == 1 << 20
                pytest.skip(f"{tier.type_name}: its server or service enforces its own limits")
            for i in range(6):
                await tier.put(key(i), payload(200_000, i))
                if i == 3:
                    assert await tier.get_bytes(key(0), 200_000) is not None  # a use
            stat = await tier.stat()
            assert stat.bytes_used <= 1 << 20 and stat.capacity == 1 << 20
            present = await tier.contains([key(i) for i in range(6)])
            assert present[0] and present[4] and present[5]  # used, and newest
            assert not present[1]  # least recently used
            assert tier.counters["evictions"] >= 1

    @asynctest
    async def test_listing(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            if not tier.supports_listing:
                with pytest.raises(StateError):
                    [k async for k in tier.keys()]
                pytest.skip(f"{tier.type_name}: no listing (supports_listing is False)")
            wanted = {key(i, group=i % 2) for i in range(25)}
            for k in wanted:
                await tier.put(k, b"v")
            assert {k async for k in tier.keys()} == wanted
            assert (await tier.stat()).objects == 25

    @asynctest
    async def test_close_and_reopen(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            await tier.put(key(1), payload(10_000, 1))
            persistent = tier.persistent
        async with make_tier() as again:
            found = await again.get_bytes(key(1), 10_000)
            if persistent:
                assert found == payload(10_000, 1)

    @asynctest
    async def test_stat_counts_objects_and_bytes(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            for i in range(3):
                await tier.put(key(i), payload(1000 * (i + 1), i))
            stat = await tier.stat()
            assert stat.objects == 3
            assert stat.bytes_used >= 6000

    # -- against a model ------------------------------------------------------------------------

    state_machine_settings = settings(max_examples=10, stateful_step_count=25, deadline=None)
    """How long `test_random_calls_match_a_dict_model` runs (a subclass on a slow store asks
    for fewer examples)."""

    def test_random_calls_match_a_dict_model(self, make_tier: MakeTier) -> None:
        """Random puts, gets, deletes, existence checks and listings (`TierStateMachine`),
        compared with a dict after every step."""
        run_state_machine_as_test(  # a factory, as hypothesis documents (its hint says a class)
            lambda: TierStateMachine(make_tier),  # type: ignore[arg-type]
            settings=self.state_machine_settings,
        )
