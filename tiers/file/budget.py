"""The tier's pool threads and its housekeeping thread: the byte budget of a `files` directory
that several processes share, one count for every namespace under it (one disk).

The count is one small file, `<path>/.kvtier/budget-v1`, read and rewritten whole under its
own `flock` (held for one `pread` and one `pwrite`, never longer than `LOCK_WAIT` to get):

- `used`: bytes of the objects on the disk, as their writers reported them landed and the
  sweeper reported them removed (and as the sweeper's scans reconcile them);
- `added`: every byte ever reported landed (a counter that only grows): a scan's count, plus
  what landed while it ran, replaces `used`, so nothing written meanwhile is lost from it;
- one entry per writing tier (its id, the bytes reserved for it, when it last wrote its entry):
  room granted and not yet given back or reported landed.

A writer reserves room before it writes (`Credit.take`): from what its tier was granted, or
by asking the ledger for more (at least `chunk` at a time, so most puts touch no file). The
directory's bytes are at most `used` plus every reservation, which a grant keeps within the
capacity, so the directory never exceeds it. Landed and removed bytes, and room held unused
for `IDLE_RETURN` seconds, are reported in the background (`Credit.flush`). An entry its writer
has not rewritten for `STALE_ENTRY` seconds is a dead process's, and dropped: every live writer
with room rewrites its entry at least every `flush`.

A ledger this process cannot write (`.kvtier` or the file another user's, read-only, immutable,
on a read-only mount) fails a writable tier's start with one line (`Ledger.check`): opening
the tier read-only instead would hide that it stores nothing.

A ledger that does not parse (garbage, a crafted file, one cut short) is rewritten as full,
`used` at the capacity, and marked for a scan: writes wait for the sweeper's next scan instead
of trusting what a stranger wrote. A newer kvtier keeps its count in another file (the version
is in the name).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from tiering.errors import ConfigError, TierFull
from tiers.file.locks import META, REFUSED, lock, meta_dir, open_regular, same_file, unlock

__all__ = ["IDLE_RETURN", "LOCK_WAIT", "STALE_ENTRY", "Credit", "Ledger", "LedgerState"]

log = logging.getLogger(__name__)

LOCK_WAIT = 0.05
"""Seconds a caller tries for the ledger's lock (its holders hold it for microseconds)."""
STALE_ENTRY = 60.0
"""Seconds after which a writer's entry that was not rewritten is a dead process's."""
IDLE_RETURN = 1.0
"""Seconds room may lie reserved and unused before it is given back."""
_MAGIC = b"KVTBUDGT"
_HEAD = struct.Struct("<8sIIQQQdI4xQ")  # magic, version, entries, used, added, capacity,
# reconciled (Unix time), flags, wanted
_SUM = struct.Struct("<Q")
_ENTRY = struct.Struct("<8sQd")  # writer id, reserved bytes, written at (Unix time)
_VERSION = 1
_FILE = f"budget-v{_VERSION}"
MAX_ENTRIES = 160
_SIZE = 4096
_NEEDS_SCAN = 1
_WRAP = 1 << 64


@dataclass(slots=True)
class LedgerState:
    """The ledger's content (the thread holding its lock: a working copy)."""

    used: int = 0
    added: int = 0
    capacity: int = 0
    reconciled: float = 0.0
    flags: int = 0
    wanted: int = 0
    """The largest room a writer waits for (the sweeper makes it, then clears this)."""
    entries: dict[bytes, tuple[int, float]] = field(default_factory=dict)

    @property
    def reserved(self) -> int:
        return sum(reserved for reserved, _ in self.entries.values())

    @property
    def total(self) -> int:
        """Bytes the directory may hold now: landed, and reserved for writes."""
        return self.used + self.reserved

    @property
    def needs_scan(self) -> bool:
        return bool(self.flags & _NEEDS_SCAN)

    def drop_stale(self, now: float) -> None:
        for ident, (_, at) in list(self.entries.items()):
            if now - at > STALE_ENTRY or at - now > STALE_ENTRY:  # a clock far ahead too
                del self.entries[ident]

    def encode(self) -> bytes:
        head = _HEAD.pack(
            _MAGIC,
            _VERSION,
            len(self.entries),
            self.used,
            self.added % _WRAP,
            self.capacity,
            self.reconciled,
            self.flags,
            self.wanted,
        )
        table = b"".join(_ENTRY.pack(i, r, at) for i, (r, at) in self.entries.items())
        body = head + _SUM.pack(xxhash.xxh3_64_intdigest(head + table)) + table
        return body + bytes(_SIZE - len(body))

    @classmethod
    def decode(cls, raw: bytes) -> LedgerState | None:
        """The state `raw` holds, or None when it is not a ledger this version wrote whole."""
        if len(raw) < _HEAD.size + _SUM.size:
            return None
        magic, version, count, used, added, capacity, reconciled, flags, wanted = _HEAD.unpack_from(
            raw
        )
        if magic != _MAGIC or version != _VERSION or count > MAX_ENTRIES:
            return None
        start = _HEAD.size + _SUM.size
        table = raw[start : start + count * _ENTRY.size]
        if len(table) != count * _ENTRY.size:
            return None
        (checksum,) = _SUM.unpack_from(raw, _HEAD.size)
        if checksum != xxhash.xxh3_64_intdigest(raw[: _HEAD.size] + table):
            return None
        if not reconciled == reconciled:  # NaN
            return None
        entries = {}
        for at in range(0, len(table), _ENTRY.size):
            ident, reserved, written = _ENTRY.unpack_from(table, at)
            if written == written:
                entries[ident] = (reserved, written)
        return cls(used, added, capacity, reconciled, flags, wanted, entries)


class Ledger:
    """The shared count of a `files` directory (any thread: calls are serialized in the
    process by a lock, and between processes by the file's `flock`)."""

    def __init__(self, base: Path, capacity: int, name: str) -> None:
        self.name = name
        self.capacity = capacity
        self.base = base
        self._fd: int | None = None
        self._mutex = threading.Lock()
        self._said_broken = False

    @property
    def path(self) -> Path:
        return self.base / ".kvtier" / _FILE

    def _open(self) -> int | None:
        if self._fd is not None and same_file(self._fd, self.path):
            return self._fd
        if self._fd is not None:  # removed or replaced: the one at the path counts
            os.close(self._fd)
            self._fd = None
        if meta_dir(self.base, create=True) is None:
            return None
        self._fd = open_regular(self.path, create=True)
        return self._fd

    def update(self, change: Callable[[LedgerState], bool]) -> bool | None:
        """Apply `change` to the ledger under its lock and write it back when `change` says
        so; `change`'s answer, or None when the ledger could not be had in time (its lock
        held past `LOCK_WAIT`, or no file can be made)."""
        if not self._mutex.acquire(timeout=LOCK_WAIT):
            return None
        try:
            for _ in range(2):
                fd = self._open()
                if fd is None:
                    return None
                if not lock(fd, wait=LOCK_WAIT):
                    return None
                try:
                    if not same_file(fd, self.path):  # replaced while we waited: again
                        continue
                    state = self._read(fd)
                    answer = change(state)
                    if answer or state.needs_scan:
                        os.pwrite(fd, state.encode(), 0)
                    return answer
                except OSError as e:
                    log.warning("tier %r: cannot use %s: %s", self.name, self.path, e)
                    return None
                finally:
                    unlock(fd)
            return None
        finally:
            self._mutex.release()

    def check(self) -> None:
        """Raise `ConfigError` (one line: the path, the system's reason) when this process
        cannot write the ledger: `.kvtier` or the ledger owned by another user, read-only,
        immutable, on a read-only mount. A writable tier calls it at start, so an unwritable
        count fails the start instead of every put waiting `full_wait` and failing `TierFull`.
        A ledger it cannot have in time for another reason (its lock held by a stopped
        process, a planted file that `update` replaces) does not fail the start."""
        if self.update(lambda state: True) is not None:
            return
        why = self._unwritable()
        if why is not None:
            raise ConfigError(
                f"tier {self.name!r}: cannot write the directory's byte count: {why}; every put "
                "would wait for room and fail. Make it writable by this user, or open the tier "
                "read_only"
            )

    def _unwritable(self) -> str | None:
        """Why the ledger cannot be written (the failing call's path and reason), or None
        when nothing the kernel refuses on permission grounds stands in the way."""
        meta = self.base / META
        try:
            os.mkdir(meta, 0o755)
        except FileExistsError:
            pass
        except OSError as e:
            return f"{meta}: {e.strerror}" if e.errno in REFUSED else None
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            os.close(os.open(self.path, flags, 0o644))
        except OSError as e:
            return f"{self.path}: {e.strerror}" if e.errno in REFUSED else None
        return None

    def _read(self, fd: int) -> LedgerState:
        raw = os.pread(fd, _SIZE, 0)
        if not raw:
            return LedgerState(capacity=self.capacity, flags=_NEEDS_SCAN)  # a new directory
        state = LedgerState.decode(raw)
        if state is not None:
            return state
        if not self._said_broken:
            self._said_broken = True
            log.warning(
                "tier %r: %s is not a budget this kvtier wrote; counting the directory as full "
                "until the sweeper's next scan",
                self.name,
                self.path,
            )
        if os.fstat(fd).st_size > _SIZE:
            os.ftruncate(fd, _SIZE)
        return LedgerState(used=self.capacity, capacity=self.capacity, flags=_NEEDS_SCAN)

    def read(self) -> LedgerState | None:
        """The ledger as it is (None: not to be had in time)."""
        got: list[LedgerState] = []

        def look(state: LedgerState) -> bool:
            got.append(state)
            return False

        self.update(look)
        return got[0] if got else None

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Credit:
    """Room reserved in the ledger for one tier's writes (its pool threads take and give;
    its housekeeping thread reports and returns: `flush`)."""

    def __init__(
        self,
        ledger: Ledger,
        ident: bytes,
        capacity: int,
        make_room: Callable[[int], bool],
        full_wait: float,
    ) -> None:
        """`ident`: the tier's id in the ledger (its writer tag); `make_room(n)`: ask the
        sweeper for `n` bytes (whether it tried: only the sweeper's process can); `full_wait`:
        how long a put waits for room before it is `TierFull`."""
        self.ledger = ledger
        self.ident = ident
        self.capacity = capacity
        self.chunk = min(max(capacity // 64, 4096), 64 << 20)
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
            asks = (max(n - self._room, self.chunk), n - self._room)
            now = time.time()
            granted: list[int] = []

            def change(state: LedgerState) -> bool:
                state.drop_stale(now)
                mine = self._report(state, landed, removed)
                if not state.needs_scan and (  # a count not made yet grants nothing
                    self.ident in state.entries or len(state.entries) < MAX_ENTRIES
                ):
                    for ask in asks:
                        if state.total + mine + ask <= self.capacity:
                            granted.append(ask)
                            mine += ask
                            break
                if not granted:  # the sweeper makes room for the largest waiting write
                    state.wanted = min(max(state.wanted, n), self.capacity)
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

    def _report(self, state: LedgerState, landed: int, removed: int) -> int:
        """Report `landed` and `removed` bytes in `state`, taking this tier's entry out of
        it; what the entry holds after the report. The entry is this tier's own: it is
        rewritten from what the tier granted itself, never read back."""
        state.entries.pop(self.ident, None)
        if landed or removed:
            state.used = max(0, state.used + landed - removed)
            state.added = (state.added + landed) % _WRAP
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

    def flush(self, *, closing: bool = False) -> None:
        """Report landed and removed bytes, give back room unused for `IDLE_RETURN` seconds
        (all of it when `closing`), and rewrite this tier's entry while it holds room (the
        housekeeping thread, at least every second; and at close)."""
        with self._lock:
            idle = closing or time.monotonic() - self._last_take > IDLE_RETURN
            returned = self._room if idle else 0
            landed, removed = self._landed, self._removed
            if not (landed or removed or returned or self._granted):
                return
            now = time.time()

            def change(state: LedgerState) -> bool:
                mine = self._report(state, landed, removed)
                self._enter(state, max(0, mine - returned), now)
                return True

            if not self.ledger.update(change):
                return  # next time
            self._landed -= landed
            self._removed -= removed
            self._room -= returned
            self._granted = max(0, self._granted - landed - returned)
