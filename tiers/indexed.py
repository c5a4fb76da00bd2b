"""`IndexedTier`: the primitives an indexed tier answers from its own index (the runtime's
event loop, as every tier call).

A tier that keeps every key it holds in an ordered mapping in the process (`_index`, oldest
first: by write time at start, then in the order objects are written and read) answers
existence, listing, its statistics and the warm start's `newest` from it without a round trip;
the memory tier and both file layouts share these, and override one where their store can
change under them (the `files` layout asks its directory about keys another engine wrote).
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tiering.keys import BlockKey
from tiering.tier import Tier, TierStat

__all__ = ["IndexedTier"]


class IndexedTier(Tier):
    """A tier whose keys all live in `_index` (set by the subclass), oldest first."""

    supports_listing = True
    indexed = True

    _index: dict[BlockKey, Any]
    """Every key the tier holds, oldest first (a dict, or an OrderedDict for recency)."""

    @abstractmethod
    def _bytes_used(self) -> int:
        """Bytes the tier's objects take, as capacity counts them."""

    def _knows(self, key: BlockKey) -> bool | None:
        return key in self._index

    def newest(self, n: int) -> list[BlockKey]:
        return list(itertools.islice(reversed(self._index), max(0, n)))

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        index = self._index
        return [key in index for key in keys]

    async def _stat(self) -> TierStat:
        return TierStat(len(self._index), self._bytes_used(), self.capacity)

    async def _list(self) -> AsyncIterator[BlockKey]:
        for key in list(self._index):
            yield key
