"""The conformance suite's attacks (pytest): corrupt, crafted, oversized and unauthenticated
objects a stranger with write access to the store can plant, through single and batched reads.

Each must be a counted miss, deleted when it is provably damaged and the tier is writable, and
cost no more than a bounded amount of memory (`PEAK_BYTES`, measured with tracemalloc) whatever
it claims. The objects are built in `tiering.testing.crafted`. `AttackTests` is one of the
sections `tiering.testing.tier.TierConformance` is made of.
"""

from __future__ import annotations

import asyncio

import pytest

from tiering.errors import CorruptObject
from tiering.keys import store_namespace
from tiering.testing.crafted import (
    CRAFTED_BLOCK,
    PEAK_BYTES,
    corrupt_variants,
    craft,
    crafted_objects,
    peak_memory,
    stored_object,
    with_payload,
)
from tiering.testing.data import NAMESPACE, OTHER_SECRET, SECRET, key, payload
from tiering.testing.hooks import MakeTier, TierHooks, asynctest
from tiering.tier.envelope import SEEN_BYTES
from tiering.tier.format import MAX_BLOCK_BYTES, REMOVABLE
from tiering.tier.refusals import RecentRefusals

__all__ = ["AttackTests"]


class AttackTests(TierHooks):
    """What every tier does with objects it did not write honestly (test process, each test on
    its own `asyncio.run` loop)."""

    # -- verification -----------------------------------------------------------------------------

    @asynctest
    async def test_corrupt_objects_are_misses_deleted_only_when_provably_damaged(
        self, make_tier: MakeTier
    ) -> None:
        """Every refused object is a counted miss; a writable tier deletes it only when the
        damage is provable (`REMOVABLE`: checksum, torn, lying lengths, not a kvtier object,
        another key's), and leaves one of another namespace or format version in place: it
        may be a neighbour's (another model, a newer kvtier in a rolling upgrade)."""
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

    @asynctest
    async def test_a_reader_with_another_secret_or_none_destroys_nothing(
        self, make_tier: MakeTier
    ) -> None:
        """Engines of one namespace with different secrets, or one without a secret beside
        one with, share a store (a secret rolled out engine by engine, a misconfigured
        engine): each one's objects are misses to the other, counted, and stay, in both
        directions, through `get` and `get_many`; the writer still finds every block."""
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

    @asynctest
    async def test_batches_verify_like_single_calls(self, make_tier: MakeTier) -> None:
        """Backends that batch their own way (pipelines, grouped I/O) refuse, count and delete
        corrupt objects item by item, like `get`; the good ones around them still arrive."""
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

    @asynctest
    async def test_a_block_of_another_size_is_refused(self, make_tier: MakeTier) -> None:
        async with make_tier() as tier:
            await tier.put(key(1), payload(4096))
            assert await tier.get(key(1), bytearray(8192)) is False
            assert tier.counters["corrupt.length"] == 1

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
    @asynctest
    async def test_crafted_objects_are_refused(
        self, make_tier: MakeTier, case: str, codec: str
    ) -> None:
        """Through the fast path (a raw tier reading into the caller's buffer) and the
        decoding one (an lz4 tier): a counted miss, deleted, memory bounded, the block unused."""
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

    @asynctest
    async def test_crafted_objects_in_batches(self, make_tier: MakeTier) -> None:
        """Batched reads (each backend's own pipelines, groups and runs) refuse every crafted
        object item by item; the good blocks among them still arrive."""
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
            found, peak = await peak_memory(tier.get_many(list(zip(keys, buffers, strict=True))))
            assert found == [False] * len(cases) + [True] * 3, found
            assert all(bytes(buffers[-3 + i]) == good[i][1] for i in range(3))
            refused = sum(v for n, v in tier.counters.items() if n.startswith("corrupt."))
            assert refused == len(cases), dict(tier.counters)
            assert peak < PEAK_BYTES + (len(keys) + 1) * size, peak

    @asynctest
    async def test_an_object_far_larger_than_its_block_is_not_read(
        self, make_tier: MakeTier
    ) -> None:
        """An object whose header claims a small block but which is huge (a sparse file of
        gigabytes, a 32 MiB value): refused from its size, without reading or allocating it,
        by single and batched reads; an operator's `read_head` reads only its head, and
        `read_object` refuses one larger than any block may be."""
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
            batch, peak = await peak_memory(tier.get_many([(k, buffers[0]), (good, buffers[1])]))
            assert batch == [False, True] and buffers[1] == payload(size, 4)
            assert tier.counters["corrupt.length"] == 2 and peak < PEAK_BYTES, peak
            await self.raw_put_large(tier, k, head, self.large_object_bytes)
            got, peak = await peak_memory(tier.read_head(k))
            assert got is not None and got[0][:100] == head[:100]
            assert got[1] == self.large_object_bytes and peak < PEAK_BYTES, peak
            if self.large_object_bytes > tier.object_limit(MAX_BLOCK_BYTES):
                with pytest.raises(CorruptObject, match="length"):
                    await tier.read_object(k)

    # -- authenticated objects -------------------------------------------------------------------

    @asynctest
    async def test_authenticated_round_trip(self, make_tier: MakeTier) -> None:
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

    @asynctest
    async def test_objects_without_a_valid_mac_are_refused(self, make_tier: MakeTier) -> None:
        """With a secret, what a stranger can plant with valid checksums is a counted miss:
        an object with no MAC, one under another secret, and one whose payload was altered
        with its checksums recomputed; through `get` and `get_many` alike."""
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

    # -- names under a secret --------------------------------------------------------------------

    @asynctest
    async def test_deployments_of_different_secrets_never_share_a_name(
        self, make_tier: MakeTier
    ) -> None:
        """Each deployment stores a layout's blocks under its own secret's store namespace
        (`tiering.keys.store_namespace`): a writer without the secret, with another one, or
        with the secret before a rotation, that writes 20 blocks first occupies none of the
        owner's names. The owner stores all 20 (no duplicate), hits all 20, and so does a
        fresh owner after it; the first writer's objects stay its own."""
        async with make_tier() as probe:
            if not (probe.persistent or probe.shared):
                pytest.skip(f"{probe.type_name}: two tier instances share no store")
        ours = store_namespace(NAMESPACE, SECRET)
        blocks = [(key(i), payload(4096, i)) for i in range(20)]
        for first in (None, OTHER_SECRET):
            theirs = store_namespace(NAMESPACE, first)
            planted = [(k, payload(4096, 100 + i)) for i, (k, _) in enumerate(blocks)]
            async with make_tier(secret=first, namespace=theirs) as planter:
                assert await planter.put_many(planted) == [None] * 20
            async with make_tier(secret=SECRET, namespace=ours) as owner:
                for k, _ in blocks:
                    await owner.delete(k)
                assert await owner.put_many(blocks) == [None] * 20
                assert owner.counters["duplicates"] == 0, dict(owner.counters)
                buffers = [bytearray(4096) for _ in blocks]
                found = await owner.get_many(
                    [(k, b) for (k, _), b in zip(blocks, buffers, strict=True)]
                )
                assert found == [True] * 20 and buffers == [d for _, d in blocks], first
            async with make_tier(secret=SECRET, namespace=ours, read_only=self.one_writer) as fresh:
                found = await fresh.get_many([(k, bytearray(4096)) for k, _ in blocks])
                assert found == [True] * 20, (first, dict(fresh.counters))
            async with make_tier(
                secret=first, namespace=theirs, read_only=self.one_writer
            ) as again:
                buffers = [bytearray(4096) for _ in planted]
                found = await again.get_many(
                    [(k, b) for (k, _), b in zip(planted, buffers, strict=True)]
                )
                assert found == [True] * 20 and buffers == [d for _, d in planted], first

    @asynctest
    async def test_in_its_own_names_a_forgery_is_removed_and_written_over(
        self, make_tier: MakeTier
    ) -> None:
        """In its secret's store namespace an object without a valid MAC is a forgery (the
        names are no secret to whoever lists the store): a writable tier refuses it, counted,
        removes it, and its next put of the block lands, so no name is unusable for good;
        through `get` and `get_many` alike."""
        ns = store_namespace(NAMESPACE, SECRET)
        async with make_tier(secret=SECRET, namespace=ns) as tier:
            assert tier.names_owned
            size = CRAFTED_BLOCK
            data = payload(size, 6)
            altered = bytearray(data)
            altered[100] ^= 1
            planted = {
                key(1): craft(key(1), data, namespace=ns, align=tier.align),
                key(2): craft(
                    key(2), data, namespace=ns, align=tier.align, mac_secret=OTHER_SECRET
                ),
                key(3): with_payload(
                    craft(key(3), data, namespace=ns, align=tier.align, mac_secret=SECRET),
                    bytes(altered),
                ),
            }
            for k, blob in planted.items():
                await self.raw_put(tier, k, blob)
            assert await tier.get(key(1), bytearray(size)) is False
            found = await tier.get_many([(key(i), bytearray(size)) for i in (2, 3)])
            assert found == [False, False], found
            assert tier.counters["corrupt.auth"] == 3, dict(tier.counters)
            for k in planted:
                assert await self.raw_get(tier, k) is None, k
            assert await tier.put_many([(k, data) for k in planted]) == [None] * 3
            assert tier.counters["duplicates"] == 0, dict(tier.counters)
            buffers = [bytearray(size) for _ in planted]
            found = await tier.get_many(list(zip(planted, buffers, strict=True)))
            assert found == [True] * 3 and buffers == [data] * 3

    @asynctest
    async def test_a_removal_takes_only_the_object_it_refused(self, make_tier: MakeTier) -> None:
        """Engines that refuse one forgery at once remove it once: an engine whose refused
        object was replaced meanwhile (a peer removed it and wrote the block) leaves the new
        object, because a removal is conditional on the bytes the read saw."""
        ns = store_namespace(NAMESPACE, SECRET)
        async with make_tier(secret=SECRET, namespace=ns) as tier:
            size = CRAFTED_BLOCK
            data = payload(size, 8)
            forged = craft(key(1), data, namespace=ns, align=tier.align)
            good = craft(key(1), data, namespace=ns, align=tier.align, mac_secret=SECRET)
            seen = forged[:SEEN_BYTES]
            await self.raw_put(tier, key(1), good)  # written over the forgery after the read
            assert await tier._call(tier._delete_refused(key(1), seen)) is False
            assert await self.raw_get(tier, key(1)) == good
            into = bytearray(size)
            assert await tier.get(key(1), into) and into == data
            await self.raw_put(tier, key(1), forged)
            assert await tier._call(tier._delete_refused(key(1), seen)) is True
            assert await self.raw_get(tier, key(1)) is None

    @asynctest
    async def test_a_refused_object_left_in_place_is_a_fast_miss(self, make_tier: MakeTier) -> None:
        """An object a tier may not remove (another secret's, in names not its own secret's)
        is read and refused once: for a while after (`tiering.tier.refusals`), lookups of its name
        answer no without reading it, counted under `refused_skips`; after the while, the next
        lookup reads it again. It stays in place throughout."""
        async with make_tier(secret=SECRET) as tier:
            size = CRAFTED_BLOCK
            data = payload(size, 9)
            foreign = craft(key(1), data, align=tier.align, mac_secret=OTHER_SECRET)
            await self.raw_put(tier, key(1), foreign)
            await tier.put(key(2), data)
            assert await tier.get(key(1), bytearray(size)) is False
            for _ in range(5):
                assert await tier.get(key(1), bytearray(size)) is False
            assert await tier.contains([key(1), key(2)]) == [False, True]
            found = await tier.get_many([(key(1), bytearray(size)), (key(2), bytearray(size))])
            assert found == [False, True]
            assert tier.counters["corrupt.auth"] == 1, dict(tier.counters)
            assert tier.counters["refused_skips"] == 7, dict(tier.counters)
            tier.refused = RecentRefusals(hold_for=0.05)
            assert await tier.get(key(1), bytearray(size)) is False
            await asyncio.sleep(0.1)
            assert await tier.get(key(1), bytearray(size)) is False
            assert tier.counters["corrupt.auth"] == 3, dict(tier.counters)
            assert await self.raw_get(tier, key(1)) == foreign

    @asynctest
    async def test_hits_on_another_writers_objects_are_counted(self, make_tier: MakeTier) -> None:
        """Each tier instance tags what it writes; a hit on an object another instance wrote
        (another engine, or this one before a restart) is counted, through `get` and
        `get_many` alike, and a hit on its own objects is not."""
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
