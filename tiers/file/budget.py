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

- `capacity`: the directory's, recorded by its first writer with one (`claim`).

**One bound per directory.** A writable tier claims the capacity at start: one configured with
a capacity records it when none is, and is refused (`ConfigError`, one line naming both) when
another is; one configured without adopts the recorded capacity (said once in the log), or,
with none recorded yet, counts its bytes all the same and adopts the first one recorded at its
next grant. So every writer's bytes count at once, whatever it was configured with.

Every writer reserves room before it writes (`tiers.file.credit.Credit`), which a grant keeps
within the capacity: the directory's bytes are at most `used` plus every reservation, so the
directory never exceeds it. An entry its writer has not rewritten for `STALE_ENTRY` seconds is
a dead process's, and dropped: every live writer with room rewrites its entry at least every
`flush`.

A ledger this process cannot write (`.kvtier` or the file another user's, read-only, immutable,
on a read-only mount) fails a writable tier's start with one line (`Ledger.check`): opening
the tier read-only instead would hide that it stores nothing.

With a deployment's secret (`ledger_key`), the ledger's sum is a truncated HMAC: one written
without the key, or older than the newest this process has seen (its `added` went back: a
replay), counts as one that does not parse. Without a secret the sum is a checksum, which
anyone who can write the directory can make.

A ledger that does not parse (garbage, a crafted file, one cut short) is rewritten as full,
`used` at the capacity, and marked for a scan: writes wait for the sweeper's next scan instead
of trusting what a stranger wrote. A newer kvtier keeps its count in another file (the version
is in the name).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from tiering.errors import ConfigError
from tiers.file.locks import META, REFUSED, lock, meta_dir, open_regular, same_file, unlock

__all__ = ["LOCK_WAIT", "MAX_ENTRIES", "STALE_ENTRY", "WRAP", "Ledger", "LedgerState"]

log = logging.getLogger(__name__)

LOCK_WAIT = 0.05
"""Seconds a caller tries for the ledger's lock (its holders hold it for microseconds)."""
STALE_ENTRY = 60.0
"""Seconds after which a writer's entry that was not rewritten is a dead process's."""
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
_KEY_DOMAIN = b"kvtier files budget ledger v1\0"
WRAP = 1 << 64


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

    def encode(self, key: bytes | None = None) -> bytes:
        """The ledger's bytes, its table summed with `key` (`_sum`)."""
        head = _HEAD.pack(
            _MAGIC,
            _VERSION,
            len(self.entries),
            self.used,
            self.added % WRAP,
            self.capacity,
            self.reconciled,
            self.flags,
            self.wanted,
        )
        table = b"".join(_ENTRY.pack(i, r, at) for i, (r, at) in self.entries.items())
        body = head + _SUM.pack(_sum(head + table, key)) + table
        return body + bytes(_SIZE - len(body))

    @classmethod
    def decode(cls, raw: bytes, key: bytes | None = None) -> LedgerState | None:
        """The state `raw` holds, or None when it is not a ledger this version wrote whole
        (with `key`: one a writer with the key wrote)."""
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
        if checksum != _sum(raw[: _HEAD.size] + table, key):
            return None
        if not reconciled == reconciled:  # NaN
            return None
        entries = {}
        for at in range(0, len(table), _ENTRY.size):
            ident, reserved, written = _ENTRY.unpack_from(table, at)
            if written == written:
                entries[ident] = (reserved, written)
        return cls(used, added, capacity, reconciled, flags, wanted, entries)


def _sum(data: bytes, key: bytes | None) -> int:
    """The ledger's 64-bit sum of `data`: xxh3, or with `key` the first 8 bytes of its
    HMAC-SHA256 (a writer without the key cannot make one that verifies)."""
    if key is None:
        return xxhash.xxh3_64_intdigest(data)
    return int.from_bytes(hmac.new(key, data, hashlib.sha256).digest()[:8], "little")


def ledger_key(mac: bytes | None) -> bytes | None:
    """The key a ledger is authenticated with, derived from a deployment's object MAC key
    (`tiering.tier.format.mac_key`; None: no secret, no authentication)."""
    return None if mac is None else hashlib.sha256(_KEY_DOMAIN + mac).digest()


class Ledger:
    """The shared count of a `files` directory (any thread: calls are serialized in the
    process by a lock, and between processes by the file's `flock`)."""

    def __init__(self, base: Path, capacity: int, name: str, key: bytes | None = None) -> None:
        """`key`: authenticate the ledger with it (`ledger_key`); None: a checksum only."""
        self.name = name
        self.capacity = capacity
        self.base = base
        self._key = key
        self._fd: int | None = None
        self._mutex = threading.Lock()
        self._said_broken = False
        self._added = 0  # the highest `added` seen: an authenticated ledger never goes back

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
                        os.pwrite(fd, state.encode(self._key), 0)
                    if _ahead(state.added, self._added):
                        self._added = state.added
                    return answer
                except OSError as e:
                    log.warning("tier %r: cannot use %s: %s", self.name, self.path, e)
                    return None
                finally:
                    unlock(fd)
            return None
        finally:
            self._mutex.release()

    def claim(self, capacity: int | None) -> int | None:
        """The directory's capacity for a tier configured with `capacity` (None: none): record
        it when none is (a new count, or one made before any writer had a capacity), adopt
        the recorded one when `capacity` is None (saying so), and raise `ConfigError` (one
        line naming both) when another is recorded. None when neither has one, or when the
        count cannot be had now (the sweeper's scan records the capacity then)."""
        got: list[int] = []

        def change(state: LedgerState) -> bool:
            got.append(state.capacity)
            if state.capacity or not capacity:
                return False
            state.capacity = capacity
            return True

        self.update(change)
        recorded = got[0] if got else 0
        if capacity is None:
            if recorded:
                log.info(
                    "tier %r: no capacity configured; %s holds %d bytes at most, as its first "
                    "writer recorded: this tier keeps to it",
                    self.name,
                    self.base,
                    recorded,
                )
            self.capacity = recorded  # (a count found broken is rewritten full of it)
            return recorded or None
        if recorded and recorded != capacity:
            raise ConfigError(
                f"tier {self.name!r}: capacity {capacity} bytes, but {self.base} is bounded at "
                f"{recorded} bytes, recorded in {self.path} by its first writer; give every "
                "engine on a directory the same capacity (to change it, stop every writer of "
                "the directory and remove that file)"
            )
        return capacity

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
        state = LedgerState.decode(raw, self._key)
        if state is not None and (self._key is None or not _ahead(self._added, state.added)):
            return state  # (with a key, an older ledger written back is a replay)
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
        return LedgerState(
            used=self.capacity, added=self._added, capacity=self.capacity, flags=_NEEDS_SCAN
        )

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


def _ahead(a: int, b: int) -> bool:
    """Whether counter value `a` is past `b` (`added`, modulo `WRAP`)."""
    return 0 < (a - b) % WRAP < WRAP // 2
