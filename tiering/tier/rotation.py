"""A tier whose deployment secret is being rotated (`auth.previous`), on the runtime's event
loop thread like the tier it wraps.

A secret picks a store's names (`tiering.keys.store_namespace`) and seals its objects
(`tiering.tier.sealing`), so the blocks stored under a previous secret live in that secret's
names and verify only under it. `RotatingTier` writes, deletes, lists and answers for the
current secret's names (`inner`); a block not found there is looked for in each previous
secret's names (`previous`: read-only tiers of the same store, each built with its own secret),
and a hit there counts `hits_previous_secret`. `kvtier rekey` moves those blocks to the current
names; an engine whose configuration drops a secret builds no tier for it and reads nothing
sealed under it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.errors import TierError
from tiering.keys import BlockKey
from tiering.tier.base import Tier
from tiering.tier.counters import BYTES_READ, HITS, HITS_PREVIOUS_SECRET, MISSES
from tiering.tier.values import KeyLike
from tiering.tier.wrappers import ForwardingTier

__all__ = ["RotatingTier"]


class RotatingTier(ForwardingTier):
    """`inner` (the current secret's names) with a fallback for reads to `previous` (the same
    store in each previous secret's names, read-only): event loop thread. A previous tier's
    failure is a miss there (the current names answered). Batches go key by key through
    `get` (the base's `get_many` over a wrapper)."""

    def __init__(self, inner: Tier, previous: Sequence[Tier]) -> None:
        super().__init__(inner)
        self.previous = tuple(previous)

    def _knows(self, key: BlockKey) -> bool | None:
        answers = [self.inner.knows(key)] + [old.knows(key) for old in self.previous]
        if any(answers):
            return True
        return None if None in answers else False

    async def get(self, key: KeyLike, into: memoryview | bytearray) -> bool:
        if await super().get(key, into):
            return True
        for old in self.previous:
            try:
                if await old.get(key, into):
                    self._found_before(len(memoryview(into)))
                    return True
            except TierError:
                continue
        return False

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """The current names' answers, a block not there looked for in the previous names
        (the primitive under the base's `contains`, which has left out the keys refused moments
        ago: those are asked nowhere, and nothing is asked twice)."""
        found = await super()._contains(keys)
        for old in self.previous:
            missing = [i for i, there in enumerate(found) if not there]
            if not missing:
                break
            try:
                again = await old.contains([keys[i] for i in missing])
            except TierError:
                continue
            for i, there in zip(missing, again, strict=True):
                found[i] = there
        return found

    def _found_before(self, size: int) -> None:
        """Count a block found under a previous secret as a hit, not the miss the current
        names counted."""
        self.counters[MISSES] -= 1
        self.counters[HITS] += 1
        self.counters[BYTES_READ] += size
        self.counters[HITS_PREVIOUS_SECRET] += 1

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            for old in self.previous:
                try:
                    await old.close()
                except TierError:
                    continue
