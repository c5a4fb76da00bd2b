"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003): `ARCPolicy`, on a compiled core
(`_arc.c`) or, where that was not built, on `PythonARCPolicy`, the same algorithm in Python."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import filterfalse, islice
from typing import Any

from tiering.compiled import load_extension
from tiering.policies.base import EvictionPolicy, K, V

__all__ = ["ARCPolicy", "PythonARCPolicy"]


_CORE: Any = load_extension(
    "tiering.policies._arc",
    "ARC policy",
    "ARC runs in Python, at about twice the scheduler's cost per block",
    attribute="ARC",
)


class ARCPolicy(EvictionPolicy[K, V]):
    """Textbook ARC (see `PythonARCPolicy` for the algorithm). Runs on its owner's thread.

    The four lists live in one hash table of nodes linked in C (`tiering/policies/_arc.c`): a
    key that moves between lists (T1 to T2 on a use, to its ghost list on eviction, back on a
    ghost hit) is relinked in place, where the Python version removes it from one OrderedDict
    and adds it to another. Both choose the same victims and keep the same lists and target on
    any sequence of calls (`tests/tiering/test_policies.py`). Without the compiled core (kvtier
    installed without a C compiler) this runs `PythonARCPolicy`, with a warning.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        core = _CORE(capacity) if _CORE is not None else PythonARCPolicy(capacity)
        self._core = core
        self.compiled = _CORE is not None
        """Whether the compiled core runs (False: `PythonARCPolicy`)."""

    @property
    def p(self) -> float:
        """Target size of T1, between 0 and the capacity."""
        return float(self._core.p)

    @p.setter
    def p(self, value: float) -> None:
        self._core.p = value

    def get(self, key: K) -> V | None:
        return self._core.get(key)

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        return self._core.get_many(keys)

    def insert(self, key: K, value: V) -> None:
        self._core.insert(key, value)

    def insert_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        self._core.insert_many(keys, values)

    def remove(self, key: K) -> V:
        return self._core.remove(key)  # type: ignore[no-any-return]

    def touch(self, keys: Iterable[K]) -> None:
        self._core.touch(keys)

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        return self._core.evict(n, protected)

    def clear(self) -> None:
        self._core.clear()

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, key: object) -> bool:
        return key in self._core

    def lists(self) -> tuple[list[K], list[K], list[K], list[K]]:
        """T1, T2, B1 and B2, least recent first (for tests and diagnostics)."""
        return self._core.lists()


class PythonARCPolicy(EvictionPolicy[K, V]):
    """Textbook ARC, in Python: `ARCPolicy`'s fallback. Runs on its owner's thread.

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

    The scheduler calls this once per block it stores or loads, so each method is written for
    the fewest hash-table operations per key, in plain subscript statements or C-level
    iteration (`filterfalse`, `map`): on `OrderedDict`, `update(...)` and `popitem(last=False)`
    cost several times a subscript assignment or a `del` (BENCHMARKS.md, "Scheduler-side cost").
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[K, V] = OrderedDict()
        self._t2: OrderedDict[K, V] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self.p = 0.0
        """Target size of T1, between 0 and the capacity."""

    def get(self, key: K) -> V | None:
        t1 = self._t1
        if key in t1:
            return t1[key]
        t2 = self._t2
        return t2[key] if key in t2 else None

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        t1, t2 = self._t1, self._t2
        return [t2[key] if key in t2 else t1[key] if key in t1 else None for key in keys]

    def insert(self, key: K, value: V) -> None:
        self.insert_many((key,), (value,))

    def insert_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        t1, b1, b2 = self._t1, self._b1, self._b2
        if b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys):
            # Case IV only, in bulk. The owner evicted before inserting, so only the ghosts can
            # be over their bounds; trimming once after all inserts drops the same ghosts as
            # trimming after each insert (B1 while |T1|+|B1| > c, then B2 while the total > 2c).
            for key, value in zip(keys, values, strict=True):
                t1[key] = value
            self._trim_ghosts()
            return
        # Some keys are ghosts. Case IV inserts trim the ghosts only when a ghost hit is next
        # (its case depends on whether it is still a ghost, and p on the ghosts' sizes) and at
        # the end: the same ghosts go as trimming after each insert, as in the bulk path.
        t2, c = self._t2, float(self.capacity)
        untrimmed = False
        for key, value in zip(keys, values, strict=True):
            if key in b1 or key in b2:
                if untrimmed:
                    self._trim_ghosts()
                    untrimmed = False
                if key in b1:  # case II: T1 was too small
                    self.p = min(c, self.p + max(len(b2) / len(b1), 1.0))
                    del b1[key]
                    t2[key] = value
                    continue
                if key in b2:  # case III: T2 was too small
                    self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
                    del b2[key]
                    t2[key] = value
                    continue
            t1[key] = value  # case IV
            untrimmed = True
        if untrimmed:
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """Drop the least recent ghosts: from B1 while |T1|+|B1| > c, then from B2 while the
        four lists hold more than 2c keys."""
        t1, b1, b2 = self._t1, self._b1, self._b2
        c = self.capacity
        over = len(t1) + len(b1) - c
        if over > 0:
            for key in list(islice(b1, over)):
                del b1[key]
        over = len(t1) + len(self._t2) + len(b1) + len(b2) - 2 * c
        if over > 0:
            for key in list(islice(b2, over)):
                del b2[key]

    def remove(self, key: K) -> V:
        if key in self._t1:
            return self._t1.pop(key)
        return self._t2.pop(key)

    def touch(self, keys: Iterable[K]) -> None:
        t1, t2 = self._t1, self._t2
        move_to_end, pop1 = t2.move_to_end, t1.pop
        for key in keys:
            if key in t2:
                move_to_end(key)
            elif key in t1:
                t2[key] = pop1(key)

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        t1, t2 = self._t1, self._t2
        if n > len(t1) + len(t2):
            return None
        # REPLACE takes T1's LRU while |T1| > p, then T2's; applied n times that is: the first
        # ceil(|T1| - p) victims from T1, the rest from T2. When a list has nothing evictable
        # left, its share falls to the other. Every victim is chosen before anything changes.
        from_t1 = min(n, max(0, math.ceil(len(t1) - self.p)))
        is_protected = protected.__contains__
        scan1 = filterfalse(is_protected, t1)
        keys1 = list(islice(scan1, from_t1))
        keys2 = list(islice(filterfalse(is_protected, t2), n - len(keys1)))
        if len(keys1) + len(keys2) < n:
            keys1 += islice(scan1, n - len(keys1) - len(keys2))
            if len(keys1) + len(keys2) < n:
                return None
        victims = list(zip(keys1, map(t1.pop, keys1), strict=True))
        victims += zip(keys2, map(t2.pop, keys2), strict=True)
        b1, b2 = self._b1, self._b2
        for key in keys1:
            b1[key] = None
        for key in keys2:
            b2[key] = None
        return victims

    def clear(self) -> None:
        for part in (self._t1, self._t2, self._b1, self._b2):
            part.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def lists(self) -> tuple[list[K], list[K], list[K], list[K]]:
        """T1, T2, B1 and B2, least recent first (for tests and diagnostics)."""
        return list(self._t1), list(self._t2), list(self._b1), list(self._b2)
