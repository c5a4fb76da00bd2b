"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003): `ARCPolicy`, on its compiled core
(`_arc.c`). Its plain Python rendering is the tests' reference (`tests/tiering/arc_reference.py`),
not a second implementation: an install without the compiled core refuses `arc` with one line."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tiering.compiled import load_extension
from tiering.errors import ConfigError
from tiering.policies.base import EvictionPolicy, K, V

if TYPE_CHECKING:
    from tiering.policies._arc import ARC

__all__ = ["ARCPolicy"]


_CORE: Any = load_extension(
    "tiering.policies._arc",
    "ARC policy",
    "primary.eviction: arc is refused (lru works)",
    attribute="ARC",
)


class ARCPolicy(EvictionPolicy[K, V]):
    """Textbook ARC, on its compiled core. Runs on its owner's thread.

    - T1 holds keys used once since they became resident, T2 keys used at least twice; both
      are resident. B1 and B2 are their ghosts: keys recently evicted from T1 and T2 (no value).
    - `p` is the adaptive target size of T1. A miss that hits B1 means T1 was too small (p grows
      by max(|B2|/|B1|, 1)); a miss that hits B2 means T2 was (p shrinks by max(|B1|/|B2|, 1)).
    - A victim comes from T1 when |T1| > p, otherwise from T2 (REPLACE), and moves to its ghost.
    - |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, with c the capacity.

    The paper's request handler is split along the policy contract: the owner calls `evict`
    (REPLACE) when the cache is full and then `insert` (cases II-IV), and reports hits through
    `touch` (case I). Recency is updated at each use, not deferred to the end of a request
    (vLLM 0.32's ARC defers it and loses a fifth of ARC's hits on the Mooncake trace).

    The four lists live in one hash table of nodes linked in C (`tiering/policies/_arc.c`): a
    key that moves between lists (T1 to T2 on a use, to its ghost list on eviction, back on a
    ghost hit) is relinked in place. It chooses the same victims and keeps the same lists and
    target as the plain reference on any sequence of calls (`tests/tiering/test_policies.py`).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        reason = self.unavailable()
        if reason is not None:
            raise ConfigError(reason)
        self._core: ARC = _CORE(capacity)

    @classmethod
    def unavailable(cls) -> str | None:
        if _CORE is None:
            return (
                "arc needs kvtier's compiled ARC core (tiering/policies/_arc.c), which this "
                "install lacks: reinstall kvtier with a C compiler present, or use lru"
            )
        return None

    @property
    def p(self) -> float:
        """Target size of T1, between 0 and the capacity."""
        return float(self._core.p)

    @p.setter
    def p(self, value: float) -> None:
        self._core.p = value

    def get(self, key: K) -> V | None:
        value: V | None = self._core.get(key)
        return value

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        values: list[V | None] = self._core.get_many(keys)
        return values

    def insert(self, key: K, value: V) -> None:
        self._core.insert(key, value)

    def insert_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        self._core.insert_many(keys, values)

    def remove(self, key: K) -> V:
        value: V = self._core.remove(key)
        return value

    def touch(self, keys: Iterable[K]) -> None:
        self._core.touch(keys)

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        victims: list[tuple[K, V]] | None = self._core.evict(n, protected)
        return victims

    def hottest(self, n: int) -> list[K]:
        """T2 (used at least twice), then T1, each most recent first: a key used again is
        worth more than one used once (from `lists`: both copied, O(resident + ghosts))."""
        t1, t2, _, _ = self._core.lists()
        order = [*reversed(t2), *reversed(t1)]
        return order[: max(0, n)]

    def clear(self) -> None:
        self._core.clear()

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, key: object) -> bool:
        return key in self._core

    def lists(self) -> tuple[list[K], list[K], list[K], list[K]]:
        """T1, T2, B1 and B2, least recent first (for tests and diagnostics)."""
        lists: tuple[list[K], list[K], list[K], list[K]] = self._core.lists()
        return lists
