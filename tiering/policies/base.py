"""The eviction-policy contract.

An eviction policy is a small object that holds the resident keys of one cache (with a value
each: for the primary pool, the slot), remembers their use, and chooses victims. It knows
nothing of ref counts, pins or events: the owner (`tiering.primary.PrimaryPool`) owns those and
tells the policy which keys may not go through `protected`. LRU and ARC therefore differ only
in this object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

__all__ = ["EvictionPolicy", "K", "V"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class EvictionPolicy(ABC, Generic[K, V]):
    """Residency and recency of one cache's keys. Runs on its owner's thread; not thread-safe.

    Guaranteed by the owner:
    - `insert` is called only for a key that is not resident;
    - `remove` is called only for a resident key;
    - the number of resident keys never exceeds `capacity` (the owner evicts first).

    The implementation must:
    - make every operation amortized O(1) (`evict`: O(n) for n victims, plus the protected keys
      it has to step over, which the owner keeps few in the common case);
    - make `evict` atomic: evict exactly `n` unprotected keys, or change nothing and return None.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity
        """The most keys the owner will keep resident (ARC sizes its ghost lists from it)."""

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this policy cannot run in this install (a missing compiled part), as one line;
        None when it can. The config loader refuses a policy that cannot run."""
        return None

    @abstractmethod
    def get(self, key: K) -> V | None:
        """The value of a resident key, or None. Has no effect on recency."""

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        """`get` of each key, in order. Override where a bulk form is faster."""
        get = self.get
        return [get(key) for key in keys]

    @abstractmethod
    def insert(self, key: K, value: V) -> None:
        """Make a key resident as most recently used (a new block, just admitted)."""

    def insert_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        """`insert` each key with its value, in order. Override where a bulk form is faster."""
        for key, value in zip(keys, values, strict=True):
            self.insert(key, value)

    @abstractmethod
    def remove(self, key: K) -> V:
        """Drop a resident key without it counting as an eviction (no ghost entry); its value."""

    @abstractmethod
    def touch(self, keys: Iterable[K]) -> None:
        """Record a use of each resident key, in order (the last is the most recent).

        Keys that are not resident are ignored: a touch races with evictions by design.
        """

    @abstractmethod
    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        """Choose and drop `n` resident keys not in `protected`, in eviction order.

        Returns the victims with their values, or None when fewer than `n` keys are evictable;
        then nothing changed. `n == 0` returns an empty list.
        """

    def hottest(self, n: int) -> list[K]:
        """Up to `n` resident keys, the one the policy would keep longest first: what a
        restarted engine reads back first (`tiering.manager.manifest`). O(resident keys).
        Default: none (a policy that cannot say gets no manifest)."""
        return []

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, resident or remembered (ghosts), and any adaptive state."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether a key is resident (ghosts are not)."""
