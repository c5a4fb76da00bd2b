"""The conformance suite every tier inherits (pytest), shipped for authors of backends.

(Over 400 lines: one test class that every backend's test class subclasses, in sections:
round trips, verification, crafted objects, authenticated objects, concurrency,
capabilities, a model. The objects it plants are built in `tiering.testing.crafted`, the
random calls in `tiering.testing.stateful`.)

    from tiering.testing import NAMESPACE
    from tiering.testing.tier import TierConformance

    class TestMyTier(TierConformance):
        @pytest.fixture
        def make_tier(self, tmp_path):
            def make(**options):           # a fresh tier object on the same storage each call
                return MyTier(namespace=NAMESPACE, root=tmp_path, **options)
            return make

        async def raw_put(self, tier, key, blob): ...   # store object bytes, bypassing `tier`
        async def raw_get(self, tier, key): ...         # stored object bytes or None, likewise
        # optional: raw_put_large(tier, key, head, size): an object of `size` bytes that
        # starts with `head`, as cheaply as the store allows (the file tier: a sparse file)

The white-box hooks `raw_put`, `raw_get` and `raw_put_large` belong to the test class, not to
the tier: they reach the store the way a stranger would (a plain file write, a raw Redis SET,
a raw S3 PUT), so nothing planted goes through the code under test.

`make_tier` is called inside the test's event loop (tiers may bind to it); options it passes on
are `capacity`, `read_only`, `codec` and `secret`. Every test runs its body with `asyncio.run`.

The suite attacks the tier as a stranger with write access to its store would: objects whose
header is self-consistent but lies about the payload (`tiering.testing.crafted`: empty, short,
long, huge claimed lengths, offsets past the end, another block's key, compression bombs),
objects far larger than any block, and objects without a valid MAC. Each must be a counted
miss, deleted unless the tier is read-only, and must cost no more than a bounded amount of
memory (`PEAK_BYTES`, measured with tracemalloc) whatever it claims.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tiering.errors import CorruptObject, KeyFormatError, StateError, TierFull
from tiering.format import MAX_BLOCK_BYTES, REMOVABLE
from tiering.keys import BlockKey
from tiering.testing.crafted import (
    CRAFTED_BLOCK,
    LARGE_OBJECT,
    PEAK_BYTES,
    corrupt_variants,
    craft,
    crafted_objects,
    peak_memory,
    stored_object,
    with_payload,
)
from tiering.testing.data import OTHER_SECRET, SECRET, key, payload
from tiering.testing.stateful import TierStateMachine
from tiering.tier import Tier

__all__ = ["MakeTier", "TierConformance"]

MakeTier = Callable[..., Tier]
"""`make_tier(**options)`: a fresh tier object on the same storage at each call."""


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


class TierConformance:
    """The behaviour every tier must show, run by pytest in the test process (each test's body
    on its own `asyncio.run` loop, the tier's thread). Subclasses provide `make_tier`,
    `raw_put` and `raw_get`; tests of capabilities a tier does not declare are skipped for it."""

    @pytest.fixture
    def make_tier(self) -> MakeTier:
        raise NotImplementedError("a TierConformance subclass provides the make_tier fixture")

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        raise NotImplementedError("a TierConformance subclass provides raw_put")

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        raise NotImplementedError("a TierConformance subclass provides raw_get")

    async def raw_put_large(self, tier: Tier, key: BlockKey, head: bytes, size: int) -> None:
        """Store an object of `size` bytes that starts with `head` (zeros after it), bypassing
        `tier`. Override where the store can make one cheaply (a sparse file)."""
        await self.raw_put(tier, key, head + bytes(size - len(head)))

    large_object_bytes = LARGE_OBJECT
    """The size `raw_put_large` is asked for (a subclass with sparse files asks for more)."""
    one_writer = False
    """The store takes one writable tier at a time (the file tier's segment layout): tests of
    two tiers on one store open the second read-only."""

    # -- round trips ----------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4095, 4096, 65539, 2 << 20, 8 << 20])
    def test_round_trip(self, make_tier: MakeTier, size: int) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                data = payload(size, seed=size)
                await tier.put(key(size), data)
                into = bytearray(size)
                assert await tier.get(key(size), into) is True
                assert into == data
                assert tier.counters["hits"] == 1

        run(body())

    def test_round_trip_into_a_memoryview_slice(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                data = payload(8192, seed=3)
                await tier.put(key(1), memoryview(data))
                region = bytearray(3 * 8192)
                assert await tier.get(key(1), memoryview(region)[8192:16384])
                assert region[8192:16384] == data and not any(region[:8192])

        run(body())

    def test_compressed_codecs(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            for codec in ("lz4", "zstd"):
                async with make_tier(codec=codec) as tier:
                    data = bytes(100_000)  # compresses well
                    await tier.put(key(7), data)
                    assert await tier.get_bytes(key(7), len(data)) == data
                    stored = await self.raw_get(tier, key(7))
                    assert stored is not None and len(stored) < 10_000

        run(body())

    def test_miss_is_a_miss(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                into = bytearray(b"untouched")
                assert await tier.get(key(404), into) is False
                assert into == b"untouched"
                assert tier.counters["misses"] == 1 and not any(
                    k.startswith("corrupt") for k in tier.counters
                )

        run(body())

    def test_overwrite(self, make_tier: MakeTier) -> None:
        """A second put of a key replaces its block, or, on a store that writes a key once
        (`Tier._write` answers False), leaves the first and is counted as a duplicate."""

        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), payload(5000, 1))
                await tier.put(key(1), payload(5000, 2))
                once = tier.counters["duplicates"] == 1
                kept = payload(5000, 1) if once else payload(5000, 2)
                assert await tier.get_bytes(key(1), 5000) == kept
                assert tier.counters["duplicate_bytes"] == (5000 if once else 0)
                assert (await tier.stat()).objects == 1

        run(body())

    def test_delete(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), b"x" * 100)
                assert await tier.delete(key(1)) is True
                assert await tier.delete(key(1)) is False
                assert await tier.get_bytes(key(1), 100) is None
                assert await self.raw_get(tier, key(1)) is None

        run(body())

    def test_contains_is_batched(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put_many([(key(i), b"v" * 10) for i in range(0, 20, 2)])
                assert await tier.contains([key(i) for i in range(20)]) == [
                    i % 2 == 0 for i in range(20)
                ]
                assert await tier.contains([]) == []

        run(body())

    def test_batches(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                results = await tier.put_many([(key(i), payload(3000, i)) for i in range(40)])
                assert results == [None] * 40
                buffers = [bytearray(3000) for _ in range(41)]
                found = await tier.get_many([(key(i), buffers[i]) for i in range(41)])
                assert found == [True] * 40 + [False]
                assert all(buffers[i] == payload(3000, i) for i in range(40))
                assert await tier.delete_many([key(0), key(999)]) == [True, False]

        run(body())

    def test_invalid_keys_are_rejected(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                for bad in ("not-hex", "ABCDEF0123456789AB", "../../etc/passwd", "0" * 7):
                    with pytest.raises(KeyFormatError):
                        await tier.put(bad, b"x")
                    with pytest.raises(KeyFormatError):
                        await tier.get(bad, bytearray(1))
                await tier.put(key(5).hex(), b"by hex")
                assert await tier.get_bytes(key(5), 6) == b"by hex"

        run(body())

    # -- verification -----------------------------------------------------------------------------

    def test_corrupt_objects_are_misses_deleted_only_when_provably_damaged(
        self, make_tier: MakeTier
    ) -> None:
        """Every refused object is a counted miss; a writable tier deletes it only when the
        damage is provable (`REMOVABLE`: checksum, torn, lying lengths, not a kvtier object,
        another key's), and leaves one of another namespace or format version in place: it
        may be a neighbour's (another model, a newer kvtier in a rolling upgrade)."""

        async def body() -> None:
            async with make_tier() as tier:
                data = payload(4096, 9)
                for i, reason in enumerate(corrupt_variants(tier, key(1), data)):
                    k = key(100 + i)
                    blob = corrupt_variants(tier, k, data)[reason]
                    await self.raw_put(tier, k, blob)
                    assert await tier.get(k, bytearray(4096)) is False, reason
                    assert tier.counters[f"corrupt.{reason}"] == 1, reason
                    left = await self.raw_get(tier, k)
                    if reason in REMOVABLE:
                        assert left is None, f"{reason}: not deleted"
                    else:
                        assert left is not None and bytes(left) == bytes(blob), f"{reason}: gone"
                assert tier.counters["hits"] == 0

        run(body())

    def test_a_reader_with_another_secret_or_none_destroys_nothing(
        self, make_tier: MakeTier
    ) -> None:
        """Engines of one namespace with different secrets, or one without a secret beside
        one with, share a store (a secret rolled out engine by engine, a misconfigured
        engine): each one's objects are misses to the other, counted, and stay, in both
        directions, through `get` and `get_many`; the writer still finds every block."""

        async def body() -> None:
            async with make_tier() as probe:
                if not (probe.persistent or probe.shared):
                    pytest.skip(f"{probe.type_name}: two tier instances share no store")
            blocks = [(key(i), payload(4096, i)) for i in range(20)]
            for first, second in (
                (SECRET, OTHER_SECRET),
                (OTHER_SECRET, SECRET),
                (None, SECRET),
                (SECRET, None),
            ):
                async with make_tier(secret=first) as writer:
                    for k, _ in blocks:
                        await writer.delete(k)
                    assert await writer.put_many(blocks) == [None] * 20
                    async with make_tier(secret=second, read_only=self.one_writer) as reader:
                        await reader.get(blocks[0][0], bytearray(4096))
                        await reader.get_many([(k, bytearray(4096)) for k, _ in blocks[1:]])
                    if second is not None:  # a reader without a secret ignores a MAC
                        assert reader.counters["hits"] == 0, (first, second)
                        assert reader.counters["corrupt.auth"] == 20, dict(reader.counters)
                    for k, _ in blocks:
                        assert await self.raw_get(writer, k) is not None, (first, second)
                    found = await writer.get_many([(k, bytearray(4096)) for k, _ in blocks])
                    assert found == [True] * 20, (first, second, found)

        run(body())

    def test_batches_verify_like_single_calls(self, make_tier: MakeTier) -> None:
        """Backends that batch their own way (pipelines, grouped I/O) refuse, count and delete
        corrupt objects item by item, like `get`; the good ones around them still arrive."""

        async def body() -> None:
            async with make_tier() as tier:
                data = [payload(4096, i) for i in range(5)]
                good = [(key(i), data[i]) for i in (0, 2, 4)]
                assert await tier.put_many(good) == [None] * 3
                bad = corrupt_variants(tier, key(1), data[1])["checksum"]
                await self.raw_put(tier, key(1), bad)
                short = corrupt_variants(tier, key(3), data[3])["truncated"]
                await self.raw_put(tier, key(3), short)
                buffers = [bytearray(4096) for _ in range(6)]
                found = await tier.get_many([(key(i), buffers[i]) for i in range(6)])
                assert found == [True, False, True, False, True, False], found
                assert all(buffers[i] == data[i] for i in (0, 2, 4))
                assert tier.counters["corrupt.checksum"] == 1
                assert tier.counters["corrupt.truncated"] == 1
                assert await self.raw_get(tier, key(1)) is None
                assert await self.raw_get(tier, key(3)) is None

        run(body())

    def test_capacity_holds_for_batches(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier(capacity=1 << 20) as tier:
                if not tier.evicts:
                    return
                blocks = [(key(i), payload(200_000, i)) for i in range(8)]
                assert await tier.put_many(blocks[:4]) == [None] * 4
                assert await tier.put_many(blocks[4:]) == [None] * 4
                stat = await tier.stat()
                assert stat.bytes_used <= 1 << 20
                assert (await tier.contains([key(i) for i in range(8)]))[4:] == [True] * 4
                too_big = await tier.put_many([(key(20), payload(2 << 20)), blocks[0]])
                assert isinstance(too_big[0], TierFull) and too_big[1] is None

        run(body())

    def test_a_block_of_another_size_is_refused(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), payload(4096))
                assert await tier.get(key(1), bytearray(8192)) is False
                assert tier.counters["corrupt.length"] == 1

        run(body())

    # -- crafted objects: what a stranger with write access to the store can plant ---------------

    @pytest.mark.parametrize(
        "case",
        [
            "empty",
            "short",
            "header only",
            "long",
            "huge claimed length",
            "claimed block larger than any",
            "stored longer than raw",
            "offset past the end",
            "offset inside the payload",
            "key of another block",
            "lz4 bomb",
            "zstd bomb",
            "zstd bomb without size",
        ],
    )
    @pytest.mark.parametrize("codec", ["raw", "lz4"])
    def test_crafted_objects_are_refused(self, make_tier: MakeTier, case: str, codec: str) -> None:
        """Through the fast path (a raw tier reading into the caller's buffer) and the
        decoding one (an lz4 tier): a counted miss, deleted, memory bounded, the block unused."""

        async def body() -> None:
            async with make_tier(codec=codec) as tier:
                k = key(7)
                reason, blob = crafted_objects(tier, k, CRAFTED_BLOCK)[case]
                await self.raw_put(tier, k, blob)
                into = bytearray(CRAFTED_BLOCK)
                found, peak = await peak_memory(tier.get(k, into))
                assert found is False, case
                assert tier.counters[f"corrupt.{reason}"] == 1, (case, dict(tier.counters))
                assert tier.counters["hits"] == 0
                assert peak < PEAK_BYTES + CRAFTED_BLOCK, (case, peak)
                assert await self.raw_get(tier, k) is None, f"{case}: not deleted"

        run(body())

    def test_crafted_objects_in_batches(self, make_tier: MakeTier) -> None:
        """Batched reads (each backend's own pipelines, groups and runs) refuse every crafted
        object item by item; the good blocks among them still arrive."""

        async def body() -> None:
            async with make_tier() as tier:
                size = CRAFTED_BLOCK
                cases = list(crafted_objects(tier, key(0), size))
                good = [(key(1000 + i), payload(size, i)) for i in range(3)]
                assert await tier.put_many(good) == [None] * 3
                for i, case in enumerate(cases):
                    k = key(i)
                    await self.raw_put(tier, k, crafted_objects(tier, k, size)[case][1])
                keys = [key(i) for i in range(len(cases))] + [k for k, _ in good]
                buffers = [bytearray(size) for _ in keys]
                found, peak = await peak_memory(
                    tier.get_many(list(zip(keys, buffers, strict=True)))
                )
                assert found == [False] * len(cases) + [True] * 3, found
                assert all(bytes(buffers[-3 + i]) == good[i][1] for i in range(3))
                refused = sum(v for n, v in tier.counters.items() if n.startswith("corrupt."))
                assert refused == len(cases), dict(tier.counters)
                assert peak < PEAK_BYTES + (len(keys) + 1) * size, peak

        run(body())

    def test_an_object_far_larger_than_its_block_is_not_read(self, make_tier: MakeTier) -> None:
        """An object whose header claims a small block but which is huge (a sparse file of
        gigabytes, a 32 MiB value): refused from its size, without reading or allocating it,
        by single and batched reads; an operator's `read_head` reads only its head, and
        `read_object` refuses one larger than any block may be."""

        async def body() -> None:
            async with make_tier() as tier:
                size = 32 << 10
                k, good = key(3), key(4)
                head = stored_object(tier, k, payload(size, 3))[:4096]
                await self.raw_put_large(tier, k, head, self.large_object_bytes)
                found, peak = await peak_memory(tier.get(k, bytearray(size)))
                assert found is False and tier.counters["corrupt.length"] == 1, tier.counters
                assert peak < PEAK_BYTES, peak
                await self.raw_put_large(tier, k, head, self.large_object_bytes)
                await tier.put(good, payload(size, 4))
                buffers = [bytearray(size), bytearray(size)]
                batch, peak = await peak_memory(
                    tier.get_many([(k, buffers[0]), (good, buffers[1])])
                )
                assert batch == [False, True] and buffers[1] == payload(size, 4)
                assert tier.counters["corrupt.length"] == 2 and peak < PEAK_BYTES, peak
                await self.raw_put_large(tier, k, head, self.large_object_bytes)
                got, peak = await peak_memory(tier.read_head(k))
                assert got is not None and got[0][:100] == head[:100]
                assert got[1] == self.large_object_bytes and peak < PEAK_BYTES, peak
                if self.large_object_bytes > tier.object_limit(MAX_BLOCK_BYTES):
                    with pytest.raises(CorruptObject, match="length"):
                        await tier.read_object(k)

        run(body())

    # -- authenticated objects -------------------------------------------------------------------

    def test_authenticated_round_trip(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier(secret=SECRET) as tier:
                assert tier.authenticated
                data = payload(CRAFTED_BLOCK, 5)
                await tier.put(key(1), data)
                await tier.put_many([(key(2), data), (key(3), data)])
                into = bytearray(CRAFTED_BLOCK)
                assert await tier.get(key(1), into) and into == data
                buffers = [bytearray(CRAFTED_BLOCK) for _ in range(2)]
                found = await tier.get_many([(key(2), buffers[0]), (key(3), buffers[1])])
                assert found == [True, True] and buffers == [data, data]
                stored = await self.raw_get(tier, key(1))
                assert stored is not None and stored[11] & 0x80  # the MAC flag
                lasting = tier.persistent or tier.shared
            if lasting:
                async with make_tier() as plain:  # a reader without the secret ignores the MAC
                    assert await plain.get_bytes(key(1), CRAFTED_BLOCK) == data

        run(body())

    def test_objects_without_a_valid_mac_are_refused(self, make_tier: MakeTier) -> None:
        """With a secret, what a stranger can plant with valid checksums is a counted miss:
        an object with no MAC, one under another secret, and one whose payload was altered
        with its checksums recomputed; through `get` and `get_many` alike."""

        async def body() -> None:
            async with make_tier(secret=SECRET) as tier:
                size = CRAFTED_BLOCK
                data = payload(size, 6)
                altered = bytearray(data)
                altered[100] ^= 1
                ours = craft(key(9), data, align=tier.align, mac_secret=SECRET)
                planted = {
                    key(1): stored_object(tier, key(1), data),
                    key(2): craft(key(2), data, align=tier.align, mac_secret=OTHER_SECRET),
                    key(3): with_payload(
                        craft(key(3), data, align=tier.align, mac_secret=SECRET), bytes(altered)
                    ),
                }
                for k, blob in planted.items():
                    await self.raw_put(tier, k, blob)
                await self.raw_put(tier, key(9), ours)
                assert await tier.get(key(1), bytearray(size)) is False
                found = await tier.get_many([(key(i), bytearray(size)) for i in (2, 3, 9)])
                assert found == [False, False, True], found
                assert tier.counters["corrupt.auth"] == 3, dict(tier.counters)
                for k, blob in planted.items():  # (another secret's: not provably damaged)
                    left = await self.raw_get(tier, k)
                    assert left is not None and bytes(left) == bytes(blob)

        run(body())

    def test_hits_on_another_writers_objects_are_counted(self, make_tier: MakeTier) -> None:
        """Each tier instance tags what it writes; a hit on an object another instance wrote
        (another engine, or this one before a restart) is counted, through `get` and
        `get_many` alike, and a hit on its own objects is not."""

        async def body() -> None:
            async with make_tier() as probe:
                if not (probe.persistent or probe.shared):
                    pytest.skip(f"{probe.type_name}: two tier instances share no store")
            size = CRAFTED_BLOCK
            async with make_tier() as first:
                await first.put_many([(key(i), payload(size, i)) for i in range(4)])
                await first.get_many([(key(i), bytearray(size)) for i in range(4)])
                assert first.counters["hits"] == 4 and first.counters["hits_other_writer"] == 0
            async with make_tier(read_only=self.one_writer) as second:
                assert await second.get(key(0), bytearray(size))
                found = await second.get_many([(key(i), bytearray(size)) for i in range(1, 4)])
                assert found == [True] * 3
                assert second.counters["hits_other_writer"] == 4, dict(second.counters)

        run(body())

    def test_read_only(self, make_tier: MakeTier) -> None:
        async def body() -> None:
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

        run(body())

    # -- concurrency ------------------------------------------------------------------------------

    def test_concurrent_puts_and_gets_never_tear(self, make_tier: MakeTier) -> None:
        async def body() -> None:
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

        run(body())

    # -- capabilities ---------------------------------------------------------------------------

    def test_capacity_evicts_least_recently_used(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier(capacity=1 << 20) as tier:
                if not tier.evicts:  # the server or service enforces its own limits
                    assert (await tier.stat()).capacity == 1 << 20
                    return
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

        run(body())

    def test_listing(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                if not tier.supports_listing:
                    with pytest.raises(StateError):
                        [k async for k in tier.keys()]
                    return
                wanted = {key(i, group=i % 2) for i in range(25)}
                for k in wanted:
                    await tier.put(k, b"v")
                assert {k async for k in tier.keys()} == wanted
                assert (await tier.stat()).objects == 25

        run(body())

    def test_close_and_reopen(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), payload(10_000, 1))
                persistent = tier.persistent
            async with make_tier() as again:
                found = await again.get_bytes(key(1), 10_000)
                if persistent:
                    assert found == payload(10_000, 1)

        run(body())

    def test_stat_counts_objects_and_bytes(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                for i in range(3):
                    await tier.put(key(i), payload(1000 * (i + 1), i))
                stat = await tier.stat()
                assert stat.objects == 3
                assert stat.bytes_used >= 6000

        run(body())

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
