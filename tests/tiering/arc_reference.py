"""ARC as it was written before its per-key costs were cut (kvtier e547ed6), kept verbatim as
the model that `tests/tiering/test_policies.py` holds `tiering.policies.ARCPolicy` to: on any
sequence of calls both must choose the same victims and leave the same four lists and target.

A copy, not an import of history: the fast implementation may change shape, this one may not.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import islice

from tiering.policies.base import EvictionPolicy, K, V

__all__ = ["ReferenceARC"]


class ReferenceARC(EvictionPolicy[K, V]):
    """Textbook ARC. Runs on its owner's thread.

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
        value = self._t1.get(key)
        return self._t2.get(key) if value is None else value

    def insert(self, key: K, value: V) -> None:
        self.insert_many((key,), (value,))

    def insert_many(self, keys: Sequence[K], values: Sequence[V]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        c = self.capacity
        if b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys):
            # Case IV only, in bulk. The owner evicted before inserting, so only the ghosts can
            # be over their bounds; trimming once after all inserts drops the same ghosts as
            # trimming after each insert (B1 while |T1|+|B1| > c, then B2 while the total > 2c).
            t1.update(zip(keys, values, strict=True))
            for _ in range(len(t1) + len(b1) - c):
                b1.popitem(last=False)
            for _ in range(len(t1) + len(t2) + len(b1) + len(b2) - 2 * c):
                b2.popitem(last=False)
            return
        for key, value in zip(keys, values, strict=True):
            if key in b1:  # case II: T1 was too small
                self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
                del b1[key]
                t2[key] = value
            elif key in b2:  # case III: T2 was too small
                self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
                del b2[key]
                t2[key] = value
            else:  # case IV
                t1[key] = value
                if len(t1) + len(b1) > c:
                    b1.popitem(last=False)
                elif len(t1) + len(b1) + len(t2) + len(b2) > 2 * c:
                    b2.popitem(last=False)

    def remove(self, key: K) -> V:
        if key in self._t1:
            return self._t1.pop(key)
        return self._t2.pop(key)

    def touch(self, keys: Iterable[K]) -> None:
        t1, t2 = self._t1, self._t2
        move_to_end = t2.move_to_end
        for key in keys:
            try:
                move_to_end(key)
            except KeyError:
                if key in t1:
                    t2[key] = t1.pop(key)

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        t1, t2 = self._t1, self._t2
        if n > len(t1) + len(t2):
            return None
        # REPLACE takes T1's LRU while |T1| > p, then T2's; applied n times that is: the first
        # ceil(|T1| - p) victims from T1, the rest from T2. When a list has nothing evictable
        # left, its share falls to the other. Every victim is chosen before anything changes.
        from_t1 = min(n, max(0, math.ceil(len(t1) - self.p)))
        scan1 = (key for key in t1 if key not in protected)
        scan2 = (key for key in t2 if key not in protected)
        keys1 = list(islice(scan1, from_t1))
        keys2 = list(islice(scan2, n - len(keys1)))
        if len(keys1) + len(keys2) < n:
            keys1 += islice(scan1, n - len(keys1) - len(keys2))
            if len(keys1) + len(keys2) < n:
                return None
        pop1, pop2 = t1.pop, t2.pop
        victims = [(key, pop1(key)) for key in keys1]
        victims += [(key, pop2(key)) for key in keys2]
        self._b1.update(dict.fromkeys(keys1))
        self._b2.update(dict.fromkeys(keys2))
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
