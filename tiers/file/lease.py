"""The tier's housekeeping thread (`renew` from its pool threads too): the lease of a `files`
directory's sweeper role, an `flock` on `<path>/.kvtier/sweeper.lock` with a heartbeat, the
file's mtime, that its holder renews every `BEAT_EVERY`.

The `flock` ends with its holder's process however that ends, but not when the process only
stops (SIGSTOP, a paused container, a debugger, a disk hung under it): the kernel keeps the
lock, and without the heartbeat no other writer could sweep while everyone's puts wait for room.
So the role is the lock *and* a heartbeat younger than `LEASE`:

- **Taking** (`take`): a tier that finds the lock held and its heartbeat older than `LEASE`
  breaks the lease: under the directory count's lock (`Ledger.update`: one breaker at a time),
  it looks at the heartbeat again, locks a spare file and renames it over the lock file. The
  stopped holder's lock is now on a file with no name, and the role is the breaker's.
- **Acting**: the holder removes a file or sets the count from a scan only within `LEASE / 2`
  of its last beat (`renew`, cheap while fresh). A holder whose beat lapsed (it was stopped, or
  its thread starved) renews under the count's lock, and only if its file is still the one at
  the path; otherwise it gives the role up. A breaker needs a heartbeat older than `LEASE`, so
  two tiers never act as the sweeper at once, but for the one removal a holder was making when
  it stopped (a file already judged the oldest; the other sweeper's removal of it fails).

A stopped sweeper's role moves within `LEASE` of its last beat, plus the others' next try
(`ROLE_EVERY` in `tiers.file.sweeper`, at once for a tier whose put waits for room). The
heartbeat is wall-clock time, which every process of the host shares: a clock stepped forward
by more than `LEASE / 2` can move the role early (harmless: the old holder gives it up at its
next renewal).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from tiers.file.budget import Ledger, LedgerState
from tiers.file.locks import HeldFile, holder_line, lock, meta_dir, open_regular, read_holder

__all__ = ["BEAT_EVERY", "LEASE", "Lease"]

log = logging.getLogger(__name__)

LEASE = 2.0
"""Seconds after its last heartbeat when a holder's role may be broken by another tier."""
BEAT_EVERY = 0.25
"""Seconds between two heartbeats of the holder (it beats while it sweeps and scans too)."""
_FILE = "sweeper.lock"
_SPARE = "sweeper.lock.next"


class Lease:
    """The sweeper's lease of one tier (any thread: a lock serializes `renew`, `take` and
    `close`)."""

    def __init__(self, base: Path, ledger: Ledger, name: str) -> None:
        self.base = base
        self.ledger = ledger
        self.name = name
        self._held: HeldFile | None = None
        self._beat = 0.0  # monotonic time of the last heartbeat
        self._mutex = threading.Lock()

    @property
    def holding(self) -> bool:
        return self._held is not None

    def take(self) -> bool:
        """Take the role: lock the file, or break a lease whose heartbeat is older than
        `LEASE`; whether this tier holds it now."""
        with self._mutex:
            if self._held is not None:
                return True
            meta = meta_dir(self.base, create=True)
            if meta is None:
                return False
            path = meta / _FILE
            fd = open_regular(path, create=True)
            if fd is None:
                return False
            if lock(fd):
                held: HeldFile | None = HeldFile(fd, path)
            else:
                try:
                    stale = time.time() - os.fstat(fd).st_mtime > LEASE
                except OSError:
                    stale = False
                os.close(fd)
                held = self._break(path) if stale else None
            if held is None:
                return False
            if not held.still_there:  # replaced between the open and the lock
                held.close()
                return False
            held.record(holder_line())  # its mtime is the first heartbeat
            self._held, self._beat = held, time.monotonic()
            return True

    def _break(self, path: Path) -> HeldFile | None:
        """Replace the lock file of a holder whose heartbeat lapsed by a spare one this tier
        has locked (under the count's lock, so that breakers and lapsed holders' renewals take
        turns); the spare, or None when the holder beat meanwhile or nothing could be had."""
        got: list[HeldFile] = []
        holder = read_holder(path)

        def change(state: LedgerState) -> bool:
            try:
                age = time.time() - os.lstat(path).st_mtime
            except OSError:
                return False
            if age <= LEASE:
                return False  # it beat meanwhile
            fd = open_regular(path.with_name(_SPARE), create=True)
            if fd is None:
                return False
            if not lock(fd):
                os.close(fd)
                return False
            try:
                os.rename(path.with_name(_SPARE), path)
            except OSError:
                os.close(fd)
                return False
            got.append(HeldFile(fd, path))
            log.warning(
                "tier %r: the sweeper (%s) has not renewed its lease for %.1fs; taking the role",
                self.name,
                holder,
                age,
            )
            return False

        self.ledger.update(change)
        return got[0] if got else None

    def renew(self) -> bool:
        """Whether this tier holds the role and may act as the sweeper now: beat when one is
        due; a lapsed lease is renewed only if nobody broke it (else the role is given up)."""
        with self._mutex:
            if self._held is None:
                return False
            since = time.monotonic() - self._beat
            if since < BEAT_EVERY:
                return True
            if since < LEASE / 2:  # nobody may break it yet
                return self._renew(lapsed=False)
            answer: list[bool] = []

            def change(state: LedgerState) -> bool:
                answer.append(self._renew(lapsed=True))
                return False  # the count itself is not changed

            self.ledger.update(change)
            return bool(answer and answer[0])

    def _renew(self, *, lapsed: bool) -> bool:
        held = self._held
        assert held is not None and held.fd is not None
        if not held.still_there:
            log.warning(
                "tier %r: the sweeper's lock file was %s; giving the role up",
                self.name,
                "taken over after its lease lapsed" if lapsed else "removed or replaced",
            )
            held.close()
            self._held = None
            return False
        try:
            os.utime(held.fd)
        except OSError:
            return not lapsed  # no beat: the lease lapses, and the others take the role
        self._beat = time.monotonic()
        return True

    def still_held(self) -> bool:
        """Whether the lock file is still this tier's (under the count's lock: no breaker
        can replace it meanwhile)."""
        held = self._held
        return held is not None and held.still_there

    def close(self) -> None:
        """Give the role up (another tier takes it at its next try)."""
        with self._mutex:
            if self._held is not None:
                self._held.close()
                self._held = None
