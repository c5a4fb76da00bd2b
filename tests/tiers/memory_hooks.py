"""White-box hooks of the memory tier: its dict, reached directly, bypassing the tier's encoding
and verification (the conformance suite's `raw_put` / `raw_get`, and tests that use the memory
tier as a test double and look at what it stored)."""

from __future__ import annotations

from collections.abc import Sequence

from tiering.keys import BlockKey
from tiering.tier import Buffer, Tier
from tiers.memory import MemoryTier


def plant(tier: Tier, key: BlockKey, blob: bytes) -> None:
    """Store object bytes in a memory tier as they are, replacing any."""
    assert isinstance(tier, MemoryTier)
    tier._delete_now(key)
    tier._index[key] = blob
    tier._bytes += len(blob)


def stored(tier: Tier, key: BlockKey) -> bytes | None:
    """The object bytes a memory tier holds for `key`, unverified; None when absent."""
    assert isinstance(tier, MemoryTier)
    return tier._index.get(key)


class WriteOnceMemoryTier(MemoryTier):
    """A memory tier that writes a key once, as a write-once store does (`Tier._write`
    answering False when the key is there): for tests of how the base and wrappers count."""

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool | None:
        if key in self._index:
            return False
        return await super()._write(key, parts)
