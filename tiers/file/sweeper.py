"""The tier's housekeeping thread (`tiers.file.shared`), or a pool thread of its tier waiting for
room: the one sweeper of a `files` directory, which keeps every namespace under it within the
capacity, least recently used first.

**The role.** Every writable tier with a capacity tries for the sweeper's lease
(`tiers.file.lease`: an `flock` on `<path>/.kvtier/sweeper.lock` and a heartbeat) at start,
then every `ROLE_EVERY` seconds, at once when a put of its own waits for room; the one that
holds it is the directory's sweeper, until it closes, its process ends however it ends (the
kernel releases the lock), or it stops renewing the heartbeat for `LEASE` seconds (a stopped
process: another tier breaks the lease). No other process evicts. The holder writes its pid,
host and start into the file, for operators.

**Recency.** A file's mtime is when it was last written or read: writers set it when they
write, and every engine's hits and writes that find it there set it again (`BlockFileTier`), so
one order serves them all.

**A sweep.** The sweeper reads the directory's count (`tiers.file.budget.Ledger`); above
`HIGH` of the capacity it removes files, oldest mtime first, until the count is at most `LOW` of
it. What to remove comes from its last scan of the directory: the oldest `MAX_CANDIDATES`
object files of every namespace (`<ns>/<ab>/<cd>/<key>.kv`; nothing else is ever removed, but
temporary files older than `TMP_MAX_AGE`, a write that never ended). Each is looked at again just
before it goes: one read since the scan (a newer mtime) stays. When the scan's files are spent,
it scans again; each scan also sets the count to what it found (plus what landed while it ran:
the count errs high, never low). The sweeper scans when it takes the role, when the count was
found unreadable, and at least every `RESCAN_EVERY` seconds.

A writer whose room runs short asks the sweeper (`make_room`): in the sweeper's own process it
sweeps at once, in its thread; elsewhere it waits for the sweeper's next tick (`TICK`) up to
its `full_wait`, and the put is then `TierFull`.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tiering.keys import BlockKey, key_from_hex
from tiers.file.budget import Ledger, LedgerState
from tiers.file.lease import Lease

__all__ = [
    "HIGH",
    "LOW",
    "MAKE_ROOM_SECONDS",
    "MAX_CANDIDATES",
    "ROLE_EVERY",
    "SWEEP_SECONDS",
    "TICK",
    "Sweeper",
]

log = logging.getLogger(__name__)

HIGH = 63 / 64
"""A sweep starts when the directory holds more than this share of its capacity."""
LOW = 31 / 32
"""A sweep ends when the directory holds at most this share of its capacity."""
TICK = 0.02
"""Seconds between two looks at the count by the sweeper while writes land (or wait); 0.25 s
when none did since the last look."""
ROLE_EVERY = 0.5
"""Seconds between two tries for the role by a tier that does not hold it."""
RESCAN_EVERY = 300.0
"""Seconds after which the sweeper scans the directory again even with files to remove."""
MAX_CANDIDATES = 65536
"""The oldest files a scan keeps to remove (the memory a scan holds is bounded by it)."""
SWEEP_SECONDS = 1.0
"""The longest one pass of the housekeeping thread removes files; the next pass goes on."""
MAKE_ROOM_SECONDS = 0.25
"""The longest a writer's pool thread removes files for its own write (its put waits at most
`FULL_WAIT` in all, and reads queue behind the pool's threads)."""
_HEX2 = re.compile(r"[0-9a-f]{2}")
_HEX_NS = re.compile(r"[0-9a-f]{32}")
_SUFFIX = ".kv"


class Sweeper:
    """The sweeper role of one tier: taken, kept and used on the tier's housekeeping thread;
    `make_room` from its pool threads (one sweep at a time: a lock)."""

    def __init__(
        self,
        base: Path,
        ledger: Ledger,
        capacity: int | None,
        *,
        name: str,
        own: Path,
        gone: Callable[[BlockKey], None],
        evicted: Callable[[int], None],
        tmp_max_age: float,
    ) -> None:
        """`capacity`: the directory's (`Ledger.claim`; None while none is recorded: this tier
        takes no part until one is); `own`: this tier's namespace directory; `gone(key)`: a
        key of it was evicted (for its index); `evicted(n)`: count `n` evictions."""
        self.base = base
        self.ledger = ledger
        self.capacity = capacity
        self.name = name
        self.own = own
        self._gone = gone
        self._evicted = evicted
        self.tmp_max_age = tmp_max_age
        self._lease = Lease(base, ledger, name)
        self._next_try = 0.0
        self._sweeping = threading.Lock()
        self._candidates: list[tuple[int, int, str]] = []  # (mtime ns, size, path), a heap
        self._next_scan = 0.0
        self._added = -1  # the count's `added` at the last look
        self._stopping = False
        self._busy = True
        self.scans = 0

    @property
    def holding(self) -> bool:
        return self._lease.holding

    def tick(self, urgent: bool = False) -> bool:
        """Take the role when it is free or its lease lapsed (every `ROLE_EVERY`, or at once
        when `urgent`: a writer of this tier waits for room), renew its lease while holding
        it, and sweep when the count is above `HIGH` (the housekeeping thread). Whether the
        directory is busy: the count moved since the last tick, or a writer waits (the next
        tick then comes after `TICK`)."""
        now = time.monotonic()
        if self._lease.holding:
            self._lease.renew()  # gives the role up when another tier took it
        if not self._lease.holding:
            if now < self._next_try and not urgent:
                return False
            self._next_try = now + ROLE_EVERY
            if self.capacity is None and not self._adopt():
                return False
            if not self._lease.take():
                return False
            self._next_scan = 0.0  # a new sweeper counts the directory first
            log.info(
                "tier %r: sweeping %s (capacity %d bytes)", self.name, self.base, self.capacity
            )
        self.sweep()
        return self._busy

    def _adopt(self) -> bool:
        """Take the capacity the directory's count records, once one is (a tier configured
        with none); whether it has one now."""
        state = self.ledger.read()
        if state is None or not state.capacity:
            return False
        self.capacity = state.capacity
        return True

    def make_room(self, need: int) -> bool:
        """Sweep so that `need` more bytes fit, when this tier is the sweeper (a writer's
        pool thread: from the last scan's files, without scanning); whether it swept."""
        if not self._lease.holding:
            return False
        return self.sweep(need, wait=0.2, may_scan=False, seconds=MAKE_ROOM_SECONDS)

    def sweep(
        self,
        need: int = 0,
        *,
        wait: float = 0.0,
        may_scan: bool = True,
        seconds: float = SWEEP_SECONDS,
    ) -> bool:
        """Remove least recently used files while the count is above `HIGH` of the capacity,
        or too high for `need` bytes or for the largest write waiting (`wanted`), down to
        `LOW` (and room for those), for at most `seconds` (the next pass goes on); whether
        anything was removed."""
        if not self._sweeping.acquire(timeout=wait):
            return False
        try:
            capacity = self.capacity
            if capacity is None or not self._lease.renew():
                return False
            state = self.ledger.read()
            if state is None:
                return False
            self._busy = state.wanted > 0 or state.added != self._added
            self._added = state.added
            if may_scan and (state.needs_scan or time.monotonic() >= self._next_scan):
                self._scan()
                state = self.ledger.read()
                if state is None:
                    return False
            want = max(need, state.wanted)
            if state.total <= min(int(capacity * HIGH), capacity - want):
                self._served(state.wanted)
                return False
            target = min(int(capacity * LOW), capacity - want)
            freed = self._evict(state.total - target, may_scan, time.monotonic() + seconds)
            if freed >= state.total - target:
                self._served(state.wanted)
            return freed > 0
        finally:
            self._sweeping.release()

    def _served(self, wanted: int) -> None:
        """The room a waiting writer asked for is made: clear its wish (unless a larger one
        came meanwhile)."""
        if not wanted:
            return

        def change(state: LedgerState) -> bool:
            if state.wanted <= wanted:
                state.wanted = 0
                return True
            return False

        self.ledger.update(change)

    def _evict(self, excess: int, may_scan: bool, deadline: float) -> int:
        """Remove the oldest files until `excess` bytes are freed (scanning again once, when
        the last scan's files are spent and `may_scan`), until `deadline` (monotonic) or a
        `stop`; the count learns of each batch at once. The bytes freed."""
        freed = pending = evicted = 0
        rescanned = not may_scan
        while (
            freed < excess
            and not self._stopping
            and time.monotonic() < deadline
            and self._lease.renew()  # a lapsed lease may be another tier's now
        ):
            if not self._candidates:
                if rescanned:
                    break
                rescanned = True
                self._release(pending)  # first: the scan counts without them
                pending = 0
                self._scan()
                continue
            mtime, _, path = heapq.heappop(self._candidates)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_mtime_ns != mtime or not stat.S_ISREG(st.st_mode):
                continue  # read (or rewritten) since the scan: not the oldest any more
            try:
                os.unlink(path)
            except OSError:
                continue
            freed += st.st_size
            pending += st.st_size
            evicted += 1
            self._forget(path)
            if evicted % 64 == 0:
                self._release(pending)
                pending = 0
        self._release(pending)
        if evicted:
            self._evicted(evicted)
        return freed

    def _release(self, freed: int) -> None:
        """Take `freed` bytes this sweeper removed off the count, unless its lease was broken
        since (it stopped between the removals and this report): the new sweeper's first scan,
        made after the removals, counts without them, and taking them off again would leave
        the count low."""
        if not freed:
            return

        def change(state: LedgerState) -> bool:
            if not self._lease.still_held():
                return False
            state.used = max(0, state.used - freed)
            return True

        if self.ledger.update(change) is None:
            log.warning(
                "tier %r: the count missed %d bytes evicted (the next scan has them)",
                self.name,
                freed,
            )

    def _forget(self, path: str) -> None:
        parent = os.path.dirname(os.path.dirname(os.path.dirname(path)))
        if parent == str(self.own):
            try:
                self._gone(key_from_hex(os.path.basename(path)[: -len(_SUFFIX)]))
            except ValueError:
                pass

    def _scan(self) -> None:
        """Count every object file under the directory and keep the oldest; the count becomes
        what was found, plus what landed meanwhile (`Ledger`: `added`)."""
        before = self.ledger.read()
        if before is None:
            return
        total = 0
        oldest: list[tuple[int, int, str]] = []  # a max-heap by mtime (negated)
        for seen, (mtime, size, path) in enumerate(self._objects(time.time())):
            if self._stopping or (seen % 1024 == 0 and not self._lease.renew()):
                return  # cut short: the count stays as it was
            total += size
            item = (-mtime, size, path)
            if len(oldest) < MAX_CANDIDATES:
                heapq.heappush(oldest, item)
            elif item > oldest[0]:
                heapq.heapreplace(oldest, item)
        self._candidates = [(-m, size, path) for m, size, path in oldest]
        heapq.heapify(self._candidates)
        self._next_scan = time.monotonic() + RESCAN_EVERY
        self.scans += 1
        added_before = before.added

        def change(state: LedgerState) -> bool:
            if not self._lease.still_held():  # broken while it scanned: the count is not ours
                return False
            state.used = total + (state.added - added_before) % (1 << 64)
            state.flags = 0
            state.capacity = self.capacity or state.capacity
            state.reconciled = time.time()
            state.drop_stale(time.time())
            return True

        self.ledger.update(change)

    def _objects(self, now: float) -> Iterator[tuple[int, int, str]]:
        """(mtime ns, size, path) of each object file under the directory; temporary files of
        writes that never ended are removed on the way."""
        for namespace in _dirs(str(self.base), _HEX_NS):
            for ab in _dirs(namespace, _HEX2):
                for cd in _dirs(ab, _HEX2):
                    for entry in _entries(cd):
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if not stat.S_ISREG(st.st_mode):
                            continue
                        if entry.name.endswith(_SUFFIX):
                            yield st.st_mtime_ns, st.st_size, entry.path
                        elif entry.name.endswith(".tmp") and now - st.st_mtime > self.tmp_max_age:
                            try:
                                os.unlink(entry.path)
                            except OSError:
                                pass

    def stop(self) -> None:
        """Cut a scan short (any thread, at close: a scan of a large directory takes long)."""
        self._stopping = True

    def close(self) -> None:
        """Give the role up (at close; another tier takes it at its next try)."""
        with self._sweeping:
            self._lease.close()
            self._candidates = []


def _entries(parent: str) -> list[os.DirEntry[str]]:
    """The entries of directory `parent` (none when it cannot be read)."""
    try:
        with os.scandir(parent) as entries:
            return list(entries)
    except OSError:
        return []


def _dirs(parent: str, name: re.Pattern[str]) -> list[str]:
    """The subdirectories of `parent` whose names match `name` (never a symlink)."""
    return [
        e.path
        for e in _entries(parent)
        if name.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    ]
