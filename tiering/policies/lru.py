"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import filterfalse, islice

from tiering.policies.base import EvictionPolicy, K, V

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy[K, V]):
    """LRU over one ordered dict (least recent first). Runs on its owner's thread.

    `evict` walks from the least recent end and steps over protected keys; pinned keys were
    used recently, so in the common case it steps over none.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        return list(map(self._entries.get, keys))

    def insert(self, key: K, value: V) -> None:
        self._entries[key] = value

    def insert_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        # A subscript per key: `OrderedDict.update` costs more per key than the loop.
        entries = self._entries
        for key, value in zip(keys, values, strict=True):
            entries[key] = value

    def remove(self, key: K) -> V:
        return self._entries.pop(key)

    def touch(self, keys: Iterable[K]) -> None:
        move_to_end = self._entries.move_to_end
        for key in keys:
            try:
                move_to_end(key)
            except KeyError:
                pass

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        entries = self._entries
        if n > len(entries):
            return None
        victims = list(islice(filterfalse(protected.__contains__, entries), n))
        if len(victims) < n:
            return None
        return list(zip(victims, map(entries.pop, victims), strict=True))

    def hottest(self, n: int) -> list[K]:
        """The most recently used first."""
        return list(islice(reversed(self._entries), max(0, n)))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
