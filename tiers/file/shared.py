"""A `files` directory that several processes (engines, operators' commands) use at once, as one
tier sees it: the tier's housekeeping thread, `kvtier-<tier name>-shared`, and the calls its
loop and pool threads make.

Three concepts, each in its module, held together here:

- who else writes the directory (`tiers.file.members`): `alone` tells the tier whether its
  index holds everything (it is the only writer) or the directory must be asked about keys
  the index lacks;
- the directory's byte count (`tiers.file.budget`) and its one capacity, recorded by its first
  writer with one, which every writer reserves room in before it writes (`take`, with a
  capacity configured or not: `tiers.file.credit`);
- the one sweeper (`tiers.file.sweeper`), which keeps the directory within the capacity, least
  recently used first.

The housekeeping thread looks at the members every `MEMBERS_EVERY` seconds, reports the
tier's written and removed bytes and gives back idle room every `FLUSH_EVERY`, tries for the
sweeper's role, and, holding it, looks at the count every `TICK`. Every wait in it is bounded;
`close` stops it within `_JOIN`. A read-only tier takes no member's file and no role and
reserves nothing: it only looks at the members. Evicted keys of the tier's own namespace are
queued (`gone`) for its loop to drop from its index.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from tiering.errors import ConfigError
from tiering.keys import BlockKey
from tiers.file.budget import Ledger, ledger_key
from tiers.file.credit import Credit
from tiers.file.members import MEMBERS_EVERY, Members
from tiers.file.sweeper import TICK, Sweeper

__all__ = ["FLUSH_EVERY", "SharedDirectory"]

log = logging.getLogger(__name__)

FLUSH_EVERY = 0.5
"""Seconds between two reports of a tier's written and removed bytes to the count."""
_IDLE = 0.25
"""Seconds the housekeeping thread sleeps when no write landed or waits in the directory (or
it holds no sweeper's role)."""
_JOIN = 2.0
_LAST_REPORT = 1.0
"""Seconds a closing tier tries to report its last landed bytes to the count."""


class SharedDirectory:
    """The tier's side of a shared `files` directory (built and closed on the tier's loop
    thread; `take`, `give`, `landed` and `removed` from its pool threads; the rest on its
    housekeeping thread)."""

    def __init__(
        self,
        *,
        base: Path,
        own: Path,
        namespace: bytes,
        ident: bytes,
        name: str,
        read_only: bool,
        capacity: int | None,
        tmp_max_age: float,
        full_wait: float,
        evicted: Callable[[int], None],
        mac: bytes | None = None,
    ) -> None:
        """`own`: the tier's namespace directory (of `namespace`); `ident`: its id (the writer
        tag);
        `full_wait`: how long a put waits for room (then `TierFull`); `evicted(n)`: count `n`
        evictions made by this tier's sweeper; `mac`: the deployment's object MAC key (the
        count is authenticated with a key derived from it; None: checksummed only)."""
        self.name = name
        self._ledger: Ledger | None = None
        self.capacity = capacity
        """The directory's capacity (`Ledger.claim`: the one recorded there, which a tier
        configured with none adopts); None while none is recorded, or for a read-only tier."""
        if not read_only:
            self._ledger = Ledger(base, capacity or 0, name, ledger_key(mac))
            try:
                self._ledger.check()  # before any member's file, thread or role is taken
                self.capacity = self._ledger.claim(capacity)
            except ConfigError:
                self._ledger.close()
                raise
        self.gone: deque[BlockKey] = deque()
        """Keys of the tier's namespace that its sweeper removed (for the loop's index)."""
        self.members = Members(base, namespace, ident, join=not read_only, name=name)
        self.credit: Credit | None = None
        self.sweeper: Sweeper | None = None
        if self._ledger is not None:
            self.sweeper = Sweeper(
                base,
                self._ledger,
                self.capacity,
                name=name,
                own=own,
                gone=self.gone.append,
                evicted=evicted,
                tmp_max_age=tmp_max_age,
            )
            self.credit = Credit(self._ledger, ident, self.capacity, self._make_room, full_wait)
        self._wake = threading.Event()
        self._waiting = False  # a writer waits for room: try for the sweeper's role now
        self._stop = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}-shared", daemon=True)
        self._thread.start()

    @property
    def alone(self) -> bool:
        """Whether no other process wrote the directory at the last look (any thread)."""
        return self.members.alone

    # -- the pool's threads ----------------------------------------------------------------------

    def take(self, n: int) -> None:
        """Room for a write of `n` bytes (`TierFull` when there is none in time)."""
        if self.credit is not None:
            self.credit.take(n)

    def give(self, n: int) -> None:
        if self.credit is not None:
            self.credit.give(n)

    def landed(self, n: int) -> None:
        if self.credit is not None:
            self.credit.landed(n)

    def removed(self, n: int) -> None:
        if self.credit is not None:
            self.credit.removed(n)

    def _make_room(self, n: int) -> bool:
        self._waiting = True
        self._wake.set()  # the housekeeping thread sweeps (scanning if it must) at once
        return self.sweeper is not None and self.sweeper.make_room(n)

    # -- the housekeeping thread -----------------------------------------------------------------

    def _run(self) -> None:
        next_members = time.monotonic() + MEMBERS_EVERY
        next_flush = 0.0
        while not self._stop:
            busy = False
            try:
                now = time.monotonic()
                if now >= next_members:
                    self.members.refresh()
                    next_members = now + MEMBERS_EVERY
                if self.credit is not None and now >= next_flush:
                    self.credit.flush()
                    next_flush = now + FLUSH_EVERY
                if self.sweeper is not None:
                    urgent, self._waiting = self._waiting, False
                    busy = self.sweeper.tick(urgent)
            except Exception:  # a bug must not end the thread unseen, nor spin
                log.exception("tier %r: housekeeping of %s failed", self.name, self.members.base)
            self._wake.wait(TICK if busy else _IDLE)
            self._wake.clear()

    def close(self) -> None:
        """Stop the thread, give back the tier's room and roles (the loop thread, at the
        tier's close; in a forked child, only forget them)."""
        self._stop = True
        if self.sweeper is not None:
            self.sweeper.stop()
        self._wake.set()
        if os.getpid() != self._pid:
            return
        self._thread.join(_JOIN)
        if self._thread.is_alive():
            log.warning("tier %r: housekeeping did not stop within %gs", self.name, _JOIN)
        if self.credit is not None:
            # the last report, tried for a bounded time: bytes landed and never reported
            # would leave the count low until the sweeper's next scan
            deadline = time.monotonic() + _LAST_REPORT
            while not self.credit.flush(closing=True) and time.monotonic() < deadline:
                time.sleep(0.01)
        if self.sweeper is not None:
            self.sweeper.close()
        if self._ledger is not None:
            self._ledger.close()
        self.members.leave()
