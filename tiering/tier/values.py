"""The values a secondary tier's API speaks in: keys as callers give them, buffers, what a tier
holds, what a listing sees, and where a tier keeps its blocks (any thread: values)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tiering.keys import BlockKey, key_from_hex

__all__ = [
    "HEADER_ROOM",
    "Buffer",
    "KeyLike",
    "Medium",
    "NamespaceUsage",
    "ObjectInfo",
    "TierStat",
    "as_key",
]

KeyLike = BlockKey | bytes | str
"""A key as callers may give it: a `BlockKey`, its bytes, or its canonical hex form."""
Buffer = bytes | memoryview
"""Bytes a tier reads or writes without copying them: bytes, or a view of someone's buffer."""

HEADER_ROOM = 4096
"""Bytes a stored object may take before its payload (a header is at most 182 bytes, padded to
the writer's alignment): with the block's size, what `Tier.object_limit` allows."""


class Medium(StrEnum):
    """Where a tier keeps its blocks (`Tier.medium`). The engine is told where a hit came from
    by it (vLLM's `CacheHitSource`: host, disk, external_unspecified)."""

    MEMORY = "memory"
    """This host's RAM."""
    DISK = "disk"
    """This host's storage."""
    REMOTE = "remote"
    """A server elsewhere."""


@dataclass(frozen=True, slots=True)
class TierStat:
    """What a tier holds, as `stat` answers it (any thread: a value)."""

    objects: int
    """Stored objects of this namespace (corrupt or foreign ones a backend cannot tell apart
    without reading them included)."""
    bytes_used: int
    """Bytes of those objects, headers included."""
    capacity: int | None
    """Bytes the tier may hold; None when unbounded or unknown."""


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """What one namespace holds in a tier's store, store-wide: every engine's objects (any
    thread: a value). For operators (`kvtier stats`, `kvtier purge --idle-for`) and metrics."""

    namespace: bytes
    objects: int
    bytes_used: int
    """Bytes of its objects, headers included."""
    last_write: float | None = None
    """When the newest of its objects was written (Unix time); None when the store cannot say."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A stored object as a listing sees it (any thread: a value)."""

    key: BlockKey
    size: int | None = None
    """Bytes of the stored object, when the listing knows."""
    modified: float | None = None
    """When it was written (Unix time), when the backend records it."""


def as_key(key: KeyLike) -> BlockKey:
    """A key from bytes, or from its canonical hex form (anything else is `KeyFormatError`)."""
    if isinstance(key, str):
        return key_from_hex(key)
    if not isinstance(key, bytes) or not key:
        raise TypeError(f"a key is bytes or a hex string, got {type(key).__name__}")
    return BlockKey(key)
