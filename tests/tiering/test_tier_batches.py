"""The base's batch path over a backend's batch primitives (`ReadsMany`, `WritesMany`): every
raw answer is verified, counted and refused by the base, never by the backend; and a memory tier
whose batches go through the primitives passes the conformance suite."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from tests.tiers.memory_hooks import plant, stored
from tiering.errors import CorruptObject, TierError, TierUnavailable
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE, key, payload
from tiering.testing.crafted import corrupt_variants, stored_object
from tiering.testing.tier import MakeTier, StoreDown, TierConformance
from tiering.tier import Buffer, Tier
from tiering.tier.batching import RawRead, RawWrite, ReadsMany, WritesMany
from tiers.memory import MemoryTier

SIZE = 4096


class BatchMemoryTier(MemoryTier):
    """A memory tier with batch primitives that answer what its store holds, raw: placed in
    the caller's buffer where the object is laid out for it (as a file or Redis tier does)."""

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead] | None:
        answers: list[RawRead] = []
        for k, view, limit in zip(keys, payloads, limits, strict=True):
            try:
                blob = await self._read(k, limit)
            except CorruptObject as e:
                answers.append(e)
                continue
            if blob is None or len(blob) <= len(view):
                answers.append(None if blob is None else (blob, False))
                continue
            head = len(blob) - len(view)
            view[:] = blob[head:]
            answers.append((blob[:head], True))
        return answers

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        answers: list[RawWrite] = []
        for k, parts in objects:
            try:
                answers.append(await self._write(k, parts))
            except TierError as e:  # an object over the capacity fails alone
                answers.append(e)
        return answers


class CraftedAnswers(MemoryTier):
    """A backend whose batch read answers exactly what a test sets, whatever it stores: a
    crafted object, a payload placed in the buffer, an error. It writes whatever it is given
    and answers what `writes` says."""

    def __init__(self, **options: Any) -> None:
        super().__init__(namespace=NAMESPACE, **options)
        self.answers: list[RawRead] = []
        self.writes: list[RawWrite] = []
        self.placed: dict[int, bytes] = {}
        self.deleted: list[BlockKey] = []

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead] | None:
        for i, data in self.placed.items():
            payloads[i][:] = data
        return list(self.answers)

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        return list(self.writes)

    async def _delete_refused(self, key: BlockKey, seen: bytes | None) -> bool:
        """Record what the base asks to remove (the store holds none of the answers)."""
        self.deleted.append(key)
        return True


def test_the_protocols_are_seen() -> None:
    tier = BatchMemoryTier(namespace=NAMESPACE)
    assert isinstance(tier, ReadsMany) and isinstance(tier, WritesMany)
    assert not isinstance(MemoryTier(namespace=NAMESPACE), ReadsMany)


def test_crafted_raw_answers_of_a_batch_read_are_refused_and_counted_by_the_base() -> None:
    """Whatever a backend's batch read answers, the base verifies it: damaged whole objects,
    a header whose payload placed in the buffer is not its own, an object refused unread and a
    store's error are each a miss or an error, counted as `get` counts them, and only provable
    damage is deleted; the sound object and the one the envelope opened are the hits."""
    tier = CraftedAnswers()
    data = payload(SIZE, 1)
    good = stored_object(tier, key(0), data)
    variants = corrupt_variants(tier, key(1), data)
    header = good[: len(good) - SIZE]
    view = memoryview(bytearray(data))  # an envelope opened it in the backend's thread
    tier.answers = [
        (good, False),
        (variants["checksum"], False),
        (variants["namespace"], False),
        (stored_object(tier, key(3), data)[: len(header)], True),  # its payload: garbage
        CorruptObject("length", "too large, refused unread"),
        TierUnavailable("the store went away"),
        None,
        tier.envelope.open_placed(key(7), stored_object(tier, key(7), data)[: len(header)], view),
    ]
    tier.placed = {3: bytes(SIZE), 7: data}
    keys = [key(i) for i in range(len(tier.answers))]
    buffers = [bytearray(SIZE) for _ in keys]

    found = asyncio.run(tier.get_many(list(zip(keys, buffers, strict=True))))

    assert found[:5] == [True, False, False, False, False]
    assert isinstance(found[5], TierUnavailable) and found[6:] == [False, True]
    assert bytes(buffers[0]) == data
    counted = {name: n for name, n in tier.counters.items() if n}
    assert counted == {
        "hits": 2,
        "bytes_read": 2 * SIZE,
        "misses": 5,
        "corrupt.checksum": 2,
        "corrupt.namespace": 1,
        "corrupt.length": 1,
        "errors": 1,
    }, counted
    assert tier.deleted == [key(1), key(3), key(4)]  # another namespace's object stays


def test_a_batch_write_is_counted_by_the_base() -> None:
    """A batch write's raw answers are counted as `put` counts them: a duplicate (False), a
    write, and an error in its place."""
    tier = CraftedAnswers()
    tier.writes = [False, None, TierUnavailable("down")]
    items = [(key(i), payload(SIZE, i)) for i in range(3)]

    outcomes = asyncio.run(tier.put_many(items))

    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], TierUnavailable)
    counted = {name: n for name, n in tier.counters.items() if n}
    assert counted == {
        "puts": 2,
        "duplicates": 1,
        "duplicate_bytes": SIZE,
        "bytes_written": SIZE,
        "errors": 1,
    }, counted


def test_a_batch_primitive_that_fails_whole_fails_each_key() -> None:
    class Down(CraftedAnswers):
        async def _read_many(self, *args: Any) -> list[RawRead] | None:
            raise TierUnavailable("down")

    tier = Down()
    found = asyncio.run(tier.get_many([(key(i), bytearray(SIZE)) for i in range(3)]))
    assert all(isinstance(f, TierUnavailable) for f in found)
    assert tier.counters["errors"] == 3


class TestBatchMemoryTier(TierConformance):
    @pytest.fixture
    def make_tier(self) -> MakeTier:
        def make(**options: Any) -> Tier:
            return BatchMemoryTier(**{"namespace": NAMESPACE, **options})

        return make

    @pytest.fixture
    def store_down(self) -> StoreDown:
        pytest.skip("memory: the store is the tier's own dict, which cannot go down")

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        plant(tier, key, blob)

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        return stored(tier, key)
