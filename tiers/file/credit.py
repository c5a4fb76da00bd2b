"""A `files` tier's pool threads and its housekeeping thread: the room one tier reserves in its
directory's byte count (`tiers.file.budget.Ledger`) before it writes, and reports landed,
removed or idle.

A writer reserves room before it writes (`take`): from what its tier was granted, or by asking
the count for more (at least a chunk at a time, so most puts touch no file). A chunk is the
writer's share of `RESERVED_SHARE` of the capacity among the writers the count has entries for
(`_chunk`): however many engines write, the room they hold reserved and unwritten stays about
that share (plus one object each), and the rest of the capacity holds objects. A grant keeps the
count's total (landed bytes and every writer's room) within the directory's capacity. Landed and
removed bytes, and room held unused for `IDLE_RETURN` seconds, are reported in the background
(`flush`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiering.errors import TierFull
from tiers.file.budget import MAX_ENTRIES, WRAP, Ledger, LedgerState

__all__ = ["IDLE_RETURN", "RESERVED_SHARE", "UNBOUNDED_CHUNK", "Credit"]

log = logging.getLogger(__name__)

IDLE_RETURN = 1.0
"""Seconds room may lie reserved and unused before it is given back."""
RESERVED_SHARE = 1 / 32
"""The share of a directory's capacity its writers' chunks add up to at most."""
UNBOUNDED_CHUNK = 4 << 20
"""The room a tier with no capacity takes at a time while its directory has none recorded:
its bytes count all the same, and once a capacity is recorded it holds at most this much."""


class Credit:
    """Room reserved in the ledger for one tier's writes (its pool threads take and give;
    its housekeeping thread reports and returns: `flush`)."""

    def __init__(
        self,
        ledger: Ledger,
        ident: bytes,
        capacity: int | None,
        make_room: Callable[[int], bool],
        full_wait: float,
    ) -> None:
        """`ident`: the tier's id in the ledger (its writer tag); `capacity`: the directory's
        (`Ledger.claim`), None while none is recorded (the first recorded is adopted);
        `make_room(n)`: ask the sweeper for `n` bytes (whether it tried: only the sweeper's
        process can); `full_wait`: how long a put waits for room before it is `TierFull`."""
        self.ledger = ledger
        self.ident = ident
        self.capacity = capacity
        self.chunk = UNBOUNDED_CHUNK if capacity is None else _chunk(capacity)
        self.full_wait = full_wait
        self._make_room = make_room
        self._lock = threading.Lock()
        self._room = 0  # reserved and not used yet
        self._granted = 0  # the entry's bytes in the ledger, as this tier last wrote them
        self._landed = 0  # used room, written, not reported yet
        self._removed = 0  # bytes this tier removed, not reported yet
        self._last_take = time.monotonic()
        self.waits = 0
        """Puts that waited for room (a counter; the tier reports it)."""

    def take(self, n: int) -> None:
        """Reserve `n` bytes for a write, or raise `TierFull` when the directory has no room
        within `full_wait` (the pool's thread; it may wait)."""
        with self._lock:
            self._last_take = time.monotonic()
            if self._room >= n:
                self._room -= n
                return
        deadline = time.monotonic() + self.full_wait
        waited = False
        while True:
            if self._grant(n):
                return
            if not waited:
                waited = True
                self.waits += 1
            asked = self._make_room(n)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TierFull(
                    f"no room for {n} bytes in {self.ledger.base} (capacity {self.capacity}, "
                    "shared by every engine writing there) within "
                    f"{self.full_wait:g}s"
                )
            if not asked:
                time.sleep(min(0.005, left))

    def _grant(self, n: int) -> bool:
        """Take `n` bytes of room, asking the ledger for more when this tier's is short (at
        least `chunk`, else exactly what is missing); landed and removed bytes are reported
        on the way. Whether it was taken."""
        with self._lock:
            if self._room >= n:
                self._room -= n
                return True
            landed, removed = self._landed, self._removed
            now = time.time()
            granted: list[int] = []

            def change(state: LedgerState) -> bool:
                state.drop_stale(now)
                mine = self._report(state, landed, removed)
                if self.capacity is None and state.capacity:
                    self._adopt(state.capacity)
                capacity = self.capacity
                if (capacity is None or not state.needs_scan) and (  # a count not made yet
                    self.ident in state.entries or len(state.entries) < MAX_ENTRIES
                ):
                    chunk = self.chunk
                    if capacity is not None:  # this writer's share, with the others'
                        chunk = min(chunk, _chunk(capacity, len(state.entries) + 1))
                    for ask in (max(n - self._room, chunk), n - self._room):
                        if capacity is None or state.total + mine + ask <= capacity:
                            granted.append(ask)
                            mine += ask
                            break
                if not granted and capacity is not None:  # the sweeper makes room for the
                    state.wanted = min(max(state.wanted, n), capacity)  # largest waiting write
                self._enter(state, mine, now)
                return True

            if not self.ledger.update(change):
                return False
            self._landed -= landed
            self._removed -= removed
            self._granted -= landed
            if granted:
                self._granted += granted[0]
                self._room += granted[0]
            if self._room < n:
                return False
            self._room -= n
            return True

    def _adopt(self, capacity: int) -> None:
        """The directory's capacity was recorded after this tier, configured with none,
        started: keep to it from now on (said once)."""
        self.capacity = capacity
        self.chunk = min(self.chunk, _chunk(capacity))
        log.info(
            "tier %r: no capacity configured; %s now holds %d bytes at most, as its first "
            "writer with one recorded: this tier keeps to it",
            self.ledger.name,
            self.ledger.base,
            capacity,
        )

    def _report(self, state: LedgerState, landed: int, removed: int) -> int:
        """Report `landed` and `removed` bytes in `state`, taking this tier's entry out of
        it; what the entry holds after the report. The entry is this tier's own: it is
        rewritten from what the tier granted itself, never read back."""
        state.entries.pop(self.ident, None)
        if landed or removed:
            state.used = max(0, state.used + landed - removed)
            state.added = (state.added + landed) % WRAP
        return max(0, self._granted - landed)

    def _enter(self, state: LedgerState, reserved: int, now: float) -> None:
        if reserved and (self.ident in state.entries or len(state.entries) < MAX_ENTRIES):
            state.entries[self.ident] = (reserved, now)

    def give(self, n: int) -> None:
        """Room taken and not written (a duplicate, a failed write)."""
        with self._lock:
            self._room += n

    def landed(self, n: int) -> None:
        """`n` bytes of taken room are now an object on the disk."""
        with self._lock:
            self._landed += n

    def removed(self, n: int) -> None:
        """This tier removed an object of `n` bytes (a delete, a refused object)."""
        with self._lock:
            self._removed += n

    def flush(self, *, closing: bool = False) -> bool:
        """Report landed and removed bytes, give back room unused for `IDLE_RETURN` seconds
        (all of it when `closing`), and rewrite this tier's entry while it holds room (the
        housekeeping thread, at least every second; and at close); whether nothing is left to
        report (False: the count could not be had in time)."""
        with self._lock:
            idle = closing or time.monotonic() - self._last_take > IDLE_RETURN
            returned = self._room if idle else 0
            landed, removed = self._landed, self._removed
            if not (landed or removed or returned or self._granted):
                return True
            now = time.time()

            def change(state: LedgerState) -> bool:
                mine = self._report(state, landed, removed)
                self._enter(state, max(0, mine - returned), now)
                return True

            if not self.ledger.update(change):
                return False  # next time
            self._landed -= landed
            self._removed -= removed
            self._room -= returned
            self._granted = max(0, self._granted - landed - returned)
            return True


def _chunk(capacity: int, writers: int = 1) -> int:
    """The room a tier takes at a time in a directory of `capacity` bytes that `writers`
    tiers write to (itself included)."""
    return min(max(int(capacity * RESERVED_SHARE) // max(writers, 1), 4096), 64 << 20)
