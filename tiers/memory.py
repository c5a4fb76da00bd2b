"""The memory tier: the reference implementation of the tier contract, and a test double."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tiering.errors import CorruptObject, TierFull
from tiering.keys import BlockKey
from tiering.tier import Buffer, Medium, NamespaceUsage, Tier, TierStat
from tiering.tier.counters import EVICTIONS

__all__ = ["MemoryTier"]


class MemoryTier(Tier):
    """Objects in a dict, on the runtime's event loop thread (no I/O, so no thread pool).

    Least recently used first; evicts to stay within `capacity` bytes. Its settings are the
    base's (`TierOptions`). Tests reach its dict directly (tests/tiers/memory_hooks.py)."""

    type_name = "memory"
    medium = Medium.MEMORY
    supports_listing = True
    evicts = True
    indexed = True

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(namespace=namespace, secret=secret, name=name, **options)
        self._objects: OrderedDict[BlockKey, bytes] = OrderedDict()
        self._bytes = 0
        self._last_write: float | None = None

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        blob = self._objects.get(key)
        if blob is None:
            return None
        if len(blob) > limit:
            raise CorruptObject("length", f"object of {len(blob)} bytes, at most {limit} expected")
        self._objects.move_to_end(key)
        return blob

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        blob = b"".join(parts)
        if self.capacity is not None and len(blob) > self.capacity:
            raise TierFull(
                f"tier {self.name!r}: an object of {len(blob)} bytes exceeds the capacity"
            )
        self._delete_now(key)
        if self.capacity is not None:
            while self._bytes + len(blob) > self.capacity:
                _, evicted = self._objects.popitem(last=False)
                self._bytes -= len(evicted)
                self.counters[EVICTIONS] += 1
        self._objects[key] = blob
        self._bytes += len(blob)
        self._last_write = time.time()

    async def _delete(self, key: BlockKey) -> bool:
        return self._delete_now(key)

    def knows(self, key: BlockKey) -> bool:
        return key in self._objects

    def newest(self, n: int) -> list[BlockKey]:
        return list(itertools.islice(reversed(self._objects), max(0, n)))

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self._objects for key in keys]

    async def _stat(self) -> TierStat:
        return TierStat(len(self._objects), self._bytes, self.capacity)

    async def _usage(self) -> list[NamespaceUsage]:
        """Its dict is its whole store: this namespace alone."""
        if not self._objects:
            return []
        return [NamespaceUsage(self.namespace, len(self._objects), self._bytes, self._last_write)]

    async def _list(self) -> AsyncIterator[BlockKey]:
        for key in list(self._objects):
            yield key

    def _delete_now(self, key: BlockKey) -> bool:
        blob = self._objects.pop(key, None)
        if blob is None:
            return False
        self._bytes -= len(blob)
        return True
