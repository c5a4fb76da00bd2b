"""Store-wide usage added up per namespace, within a bound (any thread; one owner at a time).

What a tier's `_usage` answers (`tiering.tier.NamespaceUsage`) is summed from a listing of its
whole store: a directory, a Redis key prefix, a bucket prefix. Anyone who can write to a shared
store can plant names of as many namespaces as they like, so the tally keeps at most
`MAX_NAMESPACES` of them; objects of a namespace beyond the bound are left out and counted in
`dropped`.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from tiering.keys import NAMESPACE_BYTES
from tiering.tier.values import NamespaceUsage

__all__ = ["MAX_NAMESPACES", "KeepsUsageMarks", "UsageTally", "namespace_of"]

log = logging.getLogger(__name__)

MAX_NAMESPACES = 65_536
"""Namespaces one usage listing keeps (~150 bytes each)."""


@runtime_checkable
class KeepsUsageMarks(Protocol):
    """Optional, for a tier that keeps a record of its own per namespace for its usage (the
    Redis tier's last-write marker; runtime thread, like every tier call): an operator's purge
    of a whole namespace drops it too."""

    async def drop_usage_marks(self) -> None: ...


def namespace_of(text: str | bytes) -> bytes | None:
    """The namespace a store's name for it gives (its 32 hex digits, lowercase, as kvtier
    writes them), or None."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            return None
    if len(text) != 2 * NAMESPACE_BYTES or text.lower() != text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


class UsageTally:
    """Objects, bytes and the newest write of each namespace, as a listing finds them."""

    def __init__(self, limit: int = MAX_NAMESPACES) -> None:
        self.limit = limit
        self._by: dict[bytes, list[float]] = {}  # namespace -> [objects, bytes, last write]
        self._written: dict[bytes, float] = {}
        self.dropped = 0
        """Objects left out: their namespace came after `limit` others."""

    def add(
        self, namespace: bytes, size: int, modified: float | None = None, objects: int = 1
    ) -> None:
        """`objects` stored objects of `size` bytes in all, written at `modified` (Unix time,
        None when the store does not say)."""
        row = self._by.get(namespace)
        if row is None:
            if len(self._by) >= self.limit:
                self.dropped += objects
                return
            row = self._by[namespace] = [0, 0, -1.0]
        row[0] += objects
        row[1] += size
        if modified is not None and modified > row[2]:
            row[2] = modified

    def written(self, namespace: bytes, when: float) -> None:
        """The namespace was last written at `when`, as the store records it apart from its
        objects (the Redis tier's marker): it takes the place of the objects' own times."""
        if namespace in self._written or len(self._written) < self.limit:
            self._written[namespace] = max(when, self._written.get(namespace, when))

    def namespaces(self) -> set[bytes]:
        return set(self._by)

    def has_write_time(self, namespace: bytes) -> bool:
        row = self._by.get(namespace)
        return namespace in self._written or (row is not None and row[2] >= 0)

    def result(self, tier: str = "") -> list[NamespaceUsage]:
        """Every namespace with objects, in namespace order (a warning names `tier` when
        objects were left out)."""
        if self.dropped:
            log.warning(
                "tier %r: usage lists %d namespaces; %d objects of more are left out",
                tier,
                self.limit,
                self.dropped,
            )
        out = []
        for namespace in sorted(self._by):
            objects, size, last = self._by[namespace]
            when = self._written.get(namespace, last if last >= 0 else None)
            if objects:
                out.append(NamespaceUsage(namespace, int(objects), int(size), when))
        return out
