"""The conformance suite's checks of an index (pytest): what an `indexed` tier's `knows` and
`newest` say, with no I/O, matches what its store holds.

`IndexTests` is one of the sections `tiering.testing.tier.TierConformance` is made of; a tier
without an index (`indexed` False) skips them.
"""

from __future__ import annotations

import pytest

from tiering.keys import BlockKey
from tiering.testing.crafted import stored_object
from tiering.testing.data import key, payload
from tiering.testing.hooks import MakeTier, TierHooks, asynctest
from tiering.tier import Tier

__all__ = ["IndexTests"]


def _skip_without_index(tier: Tier) -> None:
    if not tier.indexed:
        pytest.skip(f"{tier.type_name}: no index (indexed is False), nothing to check")


class IndexTests(TierHooks):
    """An index tells the truth (test process, each test on its own `asyncio.run` loop): a key
    it says it holds is in the store, a key the store lacks it never says it holds."""

    async def held(self, tier: Tier, keys: list[BlockKey]) -> list[bool]:
        """Whether the store holds each key, read past the tier (`raw_get`)."""
        return [await self.raw_get(tier, k) is not None for k in keys]

    @asynctest
    async def test_knows_and_newest_follow_puts_and_deletes(self, make_tier: MakeTier) -> None:
        """After puts and deletes, `knows` is True for every key the tier wrote and the store
        holds, never True for one it lacks; `newest` lists exactly the keys held, each once,
        the last written first."""
        async with make_tier() as tier:
            _skip_without_index(tier)
            keys = [key(i) for i in range(12)]
            stored = await tier.put_many([(k, payload(1000, i)) for i, k in enumerate(keys)])
            assert stored == [None] * len(keys)
            assert await tier.delete_many(keys[::3]) == [True] * 4
            await tier.put(key(20), payload(1000, 20))
            keys.append(key(20))
            held = await self.held(tier, [*keys, key(404)])
            assert held == [i % 3 != 0 for i in range(12)] + [True, False], held
            for k, there in zip([*keys, key(404)], held, strict=True):
                says = tier.knows(k)
                assert says is True if there else says is not True, (k.hex(), there, says)
            newest = tier.newest(100)
            assert len(newest) == len(set(newest)), [k.hex() for k in newest]
            assert set(newest) == {k for k, there in zip(keys, held[:-1], strict=True) if there}
            assert tier.newest(1) == [key(20)] and tier.newest(0) == []

    @asynctest
    async def test_knows_a_planted_block_once_read(self, make_tier: MakeTier) -> None:
        """An honest object another writer stored (planted with `raw_put`): whatever `knows`
        said before, once a `get` has found it the index says it holds it, and once the tier
        has deleted it, it says it does not."""
        async with make_tier() as tier:
            _skip_without_index(tier)
            k = key(7)
            await self.raw_put(tier, k, stored_object(tier, k, payload(4096, 7)))
            assert await tier.get(k, bytearray(4096)) is True
            assert tier.knows(k) is True and k in tier.newest(10)
            assert await tier.delete(k) is True
            assert tier.knows(k) is not True and k not in tier.newest(10)
            assert await self.raw_get(tier, k) is None

    @asynctest
    async def test_never_denies_another_writers_block(self, make_tier: MakeTier) -> None:
        """A block another tier instance wrote to the same store, one that was writing there
        when this one opened: `knows` answers True or None (ask `contains`), never False, and
        `contains` finds it."""
        async with make_tier() as other:
            _skip_without_index(other)
            if not (other.persistent or other.shared):
                pytest.skip(f"{other.type_name}: two tier instances share no store")
            if self.one_writer:
                pytest.skip(f"{other.type_name}: the store takes one writer at a time")
            async with make_tier() as tier:
                await tier.put(key(1), payload(4096, 1))
                await other.put(key(2), payload(4096, 2))
                assert tier.knows(key(1)) is True
                assert tier.knows(key(2)) is not False
                assert await tier.contains([key(2)]) == [True]
