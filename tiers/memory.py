"""The memory tier: the reference implementation of the tier contract, and a test double."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tiering.errors import CorruptObject, TierFull
from tiering.keys import BlockKey
from tiering.tier import Buffer, Medium, NamespaceUsage
from tiering.tier.counters import EVICTIONS
from tiers.indexed import IndexedTier

__all__ = ["MemoryTier"]


class MemoryTier(IndexedTier):
    """Objects in a dict, on the runtime's event loop thread (no I/O, so no thread pool).

    Least recently used first; evicts to stay within `capacity` bytes. Its settings are the
    base's (`TierOptions`). Tests reach its dict directly (tests/tiers/memory_hooks.py)."""

    type_name = "memory"
    medium = Medium.MEMORY
    evicts = True

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(namespace=namespace, secret=secret, name=name, **options)
        self._index: OrderedDict[BlockKey, bytes] = OrderedDict()
        """Every object, least recently used first."""
        self._bytes = 0
        self._last_write: float | None = None
        self._records: dict[str, bytes] = {}

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        blob = self._index.get(key)
        if blob is None:
            return None
        if len(blob) > limit:
            raise CorruptObject("length", f"object of {len(blob)} bytes, at most {limit} expected")
        self._index.move_to_end(key)
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
                _, evicted = self._index.popitem(last=False)
                self._bytes -= len(evicted)
                self.counters[EVICTIONS] += 1
        self._index[key] = blob
        self._bytes += len(blob)
        self._last_write = time.time()

    async def _read_record(self, name: str, limit: int) -> Buffer | None:
        blob = self._records.get(name)
        if blob is not None and len(blob) > limit:
            raise CorruptObject("length", f"record of {len(blob)} bytes, at most {limit} expected")
        return blob

    async def _write_record(self, name: str, blob: bytes) -> bool:
        self._records[name] = bytes(blob)
        return True

    async def _delete_record(self, name: str) -> bool:
        return self._records.pop(name, None) is not None

    async def _list_records(self, prefix: str, limit: int) -> list[str]:
        return sorted(name for name in self._records if name.startswith(prefix))[:limit]

    async def _delete(self, key: BlockKey) -> bool:
        return self._delete_now(key)

    def _bytes_used(self) -> int:
        return self._bytes

    async def _usage(self) -> list[NamespaceUsage]:
        """Its dict is its whole store: this namespace alone."""
        if not self._index:
            return []
        return [NamespaceUsage(self.namespace, len(self._index), self._bytes, self._last_write)]

    def _delete_now(self, key: BlockKey) -> bool:
        blob = self._index.pop(key, None)
        if blob is None:
            return False
        self._bytes -= len(blob)
        return True
