"""Encrypted payloads are sealed into reused, page-aligned buffers (`tiering.tier.scratch`):
the AES pass writes where a file tier writes from with O_DIRECT, a buffer goes back only after
its write ended, and the pool stays bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tests.tiers.memory_hooks import stored
from tiering.errors import TierUnavailable
from tiering.keys import BlockKey
from tiering.testing import SECRET, key, payload
from tiering.testing.data import NAMESPACE
from tiering.tier import Buffer
from tiering.tier.envelope import Envelope, ciphertext_buffers
from tiering.tier.scratch import Scratch, ScratchPool
from tiers.file import SegmentFileTier
from tiers.memory import MemoryTier

SIZE = 256 << 10


def test_an_encrypted_payload_lies_in_a_page_aligned_buffer_a_plain_one_in_the_callers() -> None:
    envelope = Envelope.of(NAMESPACE, secret=SECRET, encrypt=True)
    block = bytearray(payload(SIZE, 1))
    header, body = envelope.seal(key(1), block)
    assert isinstance(body, memoryview) and isinstance(body.obj, Scratch)
    assert len(body) == SIZE and bytes(body) != bytes(block)
    assert envelope.open(key(1), bytes(header) + bytes(body))[1] == block
    _, plain = Envelope.of(NAMESPACE, secret=SECRET).seal(key(2), block)
    assert memoryview(plain).obj is block  # GMAC: the caller's block itself, never pooled
    pool = ScratchPool()
    pool.give_back([plain, block, header])
    assert pool.kept == 0


def test_buffers_are_reused_after_a_put_and_the_pool_is_bounded() -> None:
    pool = ScratchPool(keep_bytes=3 * SIZE)
    lent = [pool.take(SIZE) for _ in range(5)]
    assert len({id(b) for b in lent}) == 5
    pool.give_back([memoryview(b) for b in lent])
    assert pool.kept == 3 * SIZE  # two dropped: bounded whatever was lent
    again = pool.take(SIZE)
    assert any(again is b for b in lent) and pool.kept == 2 * SIZE
    assert len(pool.take(SIZE // 2)) == SIZE // 2  # another size: a new buffer


def test_encrypted_puts_reuse_buffers_without_mixing_up_blocks() -> None:
    """Many concurrent encrypted puts, then reads: every block comes back byte for byte (a
    buffer reused while its write still ran would corrupt an object)."""
    pool = ciphertext_buffers()

    async def go() -> None:
        async with MemoryTier(namespace=NAMESPACE, secret=SECRET, encrypt=True) as tier:
            for round_ in range(3):
                items = [(key(i), payload(SIZE, 100 * round_ + i)) for i in range(12)]
                assert await tier.put_many(items) == [None] * 12
                await asyncio.gather(*(tier.put(k, d) for k, d in items[:6]))
                for k, d in items:
                    assert await tier.get_bytes(k, SIZE) == d
            assert pool.kept >= SIZE

    asyncio.run(go())


class FailingMemoryTier(MemoryTier):
    """Writes that fail after the object was sealed (a server gone mid-write)."""

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        self.seen = parts
        raise TierUnavailable("the store went away")


def test_a_buffer_whose_write_failed_is_never_handed_out_again() -> None:
    pool = ciphertext_buffers()

    async def go() -> None:
        async with FailingMemoryTier(namespace=NAMESPACE, secret=SECRET, encrypt=True) as tier:
            with pytest.raises(TierUnavailable):
                await tier.put(key(1), payload(SIZE, 1))
            failed = memoryview(tier.seen[1]).obj
            assert isinstance(failed, Scratch)
            for i in range(4):
                _, body = tier.envelope.seal(key(i), payload(SIZE, i))
                assert memoryview(body).obj is not failed

    asyncio.run(go())
    assert pool.kept <= pool.keep_bytes


def test_an_encrypted_segment_put_goes_to_disk_from_its_buffer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The segments layout writes a whole-block payload from where it lies (no bounce copy):
    a ciphertext in a page-aligned buffer qualifies as a primary slot does."""

    async def go() -> None:
        async with SegmentFileTier(
            namespace=NAMESPACE, path=tmp_path, secret=SECRET, encrypt=True
        ) as tier:
            parts = tier.envelope.seal(key(1), payload(SIZE, 1))
            assert tier._files.whole_blocks(parts)
            await tier.put(key(2), payload(SIZE, 2))
            assert await tier.get_bytes(key(2), SIZE) == payload(SIZE, 2)

    asyncio.run(go())


def test_memory_tier_stores_a_copy_not_the_reused_buffer() -> None:
    async def go() -> None:
        async with MemoryTier(namespace=NAMESPACE, secret=SECRET, encrypt=True) as tier:
            await tier.put(key(1), payload(SIZE, 1))
            first = stored(tier, key(1))
            await tier.put(key(2), payload(SIZE, 2))
            assert stored(tier, key(1)) == first and isinstance(first, bytes)

    asyncio.run(go())
