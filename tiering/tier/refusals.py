"""Names a tier refused moments ago (`RecentRefusals`, the runtime's event loop): a fast miss.

An object a read refused and left in place (a neighbour's: another namespace, a newer format;
or one a read-only tier, or a failed removal, could not remove) would be read and refused again
by every lookup, each paying a whole read (a Redis GET, an S3 request) for nothing. For
`REFUSED_FOR` seconds after a refusal, a lookup of that name answers no without asking the
store; a put of it (the tier writes the name now) forgets it at once. At most `MAX_REFUSED`
names are held, the oldest dropped first: a store full of refused objects costs a bounded
memory and, beyond it, reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Final

from tiering.keys import BlockKey

__all__ = ["MAX_REFUSED", "REFUSED_FOR", "RecentRefusals"]

REFUSED_FOR: Final = 30.0
"""Seconds a refused name stays a fast miss: long enough that a hot prefix's lookups (many a
second) read a planted object once per window, short enough that a name a neighbour rewrites
with a good object (a peer, after a removal) is found again soon."""
MAX_REFUSED: Final = 4096
"""Names held at most (~100 bytes each)."""


class RecentRefusals:
    """Names refused within `REFUSED_FOR` (the runtime's event loop; monotonic time)."""

    def __init__(self, hold_for: float = REFUSED_FOR, bound: int = MAX_REFUSED) -> None:
        self.hold_for = hold_for
        self.bound = bound
        self._until: OrderedDict[BlockKey, float] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._until)

    def note(self, key: BlockKey) -> None:
        """`key` was refused and left in place now."""
        self._until.pop(key, None)
        self._until[key] = time.monotonic() + self.hold_for
        while len(self._until) > self.bound:
            self._until.popitem(last=False)

    def fresh(self, key: BlockKey) -> bool:
        """Whether `key` was refused within the window (an expired entry is dropped)."""
        until = self._until.get(key)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._until[key]
        return False

    def holds(self, key: BlockKey) -> bool:
        """Whether `key` was refused within the window, changing nothing (any thread: an
        index's `knows` asks it)."""
        until = self._until.get(key)
        return until is not None and until > time.monotonic()

    def forget(self, key: BlockKey) -> None:
        """`key` is being written: lookups read it again."""
        self._until.pop(key, None)
