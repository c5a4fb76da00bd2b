"""The tier's housekeeping thread (`tiers.file.shared`), and the loop's at start and close: which
processes write a `files` directory now.

Each writable tier of the directory holds an `flock` on a file of its own,
`<path>/.kvtier/members/<namespace>.<id>.member`, for its life: the kernel releases it when the
process ends, however it ends (kill -9 too), in any pid namespace. A tier that finds another
member's file of its namespace locked knows that another process writes its blocks there
(`alone` is False): its index may lack what that process wrote, so the tier checks the
directory for keys its index does not hold (engines of other namespaces, other models, share
the directory's capacity but no block, and do not count). A member file nobody holds is a dead
member's, removed by the writable tier that finds it. No pid, clock or vote is trusted: only
the kernel's lock.

A member's file is locked before it gets its name (made as a temporary name, locked, then
renamed), so no process ever sees a live member's file unlocked. A read-only tier joins
nothing; it only looks. Odd entries (not a regular file, a symlink, a name kvtier does not
make) are skipped; more than `MAX_MEMBERS` entries read as "not alone" (the safe answer: a
check costs a lookup step, a wrong "alone" loses hits). A tier that has once seen another member
stays "not alone" for its life: the blocks that member wrote are not in its index, even after
the member has gone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from pathlib import Path

from tiers.file.locks import HeldFile, holder_line, lock, meta_dir, open_regular, same_file

__all__ = ["MAX_MEMBERS", "MEMBERS_EVERY", "Members"]

log = logging.getLogger(__name__)

MEMBERS_EVERY = 1.0
"""Seconds between two looks at the members (how soon a tier learns that another process
started writing its directory, or that the last other one stopped)."""
MAX_MEMBERS = 4096
"""Entries of the members' directory read in one look; beyond, a tier takes itself as not
alone."""
_NAME = re.compile(r"([0-9a-f]{32})\.([0-9a-f]{16})\.member")
_JOINING_MAX_AGE = 60.0
"""Seconds after which a member's temporary file is a crashed start's leftover."""


class Members:
    """The members of a `files` directory, as one tier sees them (its housekeeping thread
    refreshes; `alone` is read from any thread)."""

    def __init__(
        self, base: Path, namespace: bytes, ident: bytes, *, join: bool, name: str
    ) -> None:
        """`namespace`: the tier's; `ident`: this tier's id (its writer tag); `join`: take a
        member's file (a writable tier); `name`: the tier's name, for messages."""
        self.name = name
        self.namespace = namespace.hex()
        self.ident = ident.hex()
        self.join = join
        self.base = base
        self.alone = True
        """No other process held a member's file at the last look (any thread reads it)."""
        self.others = 0
        self._mine: HeldFile | None = None
        self._dir: Path | None = None
        if join:
            self._take()
        self.refresh()

    def _directory(self) -> Path | None:
        if self._dir is None:
            meta = meta_dir(self.base, create=self.join)
            if meta is not None:
                path = meta / "members"
                if self.join:
                    try:
                        os.mkdir(path, 0o755)
                    except FileExistsError:
                        pass
                    except OSError:
                        return None
                try:
                    if path.is_dir() and not path.is_symlink():
                        self._dir = path
                except OSError:
                    return None
        return self._dir

    def _take(self) -> None:
        """Hold a member's file: made under a temporary name, locked, then named."""
        where = self._directory()
        if where is None:
            log.warning(
                "tier %r: cannot make %s; other processes will not know this one writes here",
                self.name,
                self.base / ".kvtier" / "members",
            )
            return
        joining = where / f".{self.namespace}.{self.ident}.joining"
        fd = open_regular(joining, create=True)
        if fd is None or not lock(fd):
            if fd is not None:
                os.close(fd)
            return
        held = HeldFile(fd, where / f"{self.namespace}.{self.ident}.member")
        held.record(holder_line())
        try:
            os.rename(joining, held.path)
        except OSError:
            held.close()
            return
        self._mine = held

    def refresh(self) -> None:
        """Look at the members now (the housekeeping thread, every `MEMBERS_EVERY`)."""
        if self._mine is not None and not self._mine.still_there:  # removed by a stranger
            self._mine.close()
            self._mine = None
            self._take()
        self.others = self._count_others()
        # Once another process has written here, this index lacks what it wrote, whether or
        # not it still runs: a tier that was once beside another stays "not alone" for life.
        self.alone = self.alone and self.others == 0

    def _count_others(self) -> int:
        where = self._directory()
        if where is None:
            return 0
        others = 0
        now = time.time()
        try:
            with os.scandir(where) as entries:
                for n, entry in enumerate(entries):
                    if n >= MAX_MEMBERS:
                        return others + 1
                    name = entry.name
                    if name.endswith(".joining"):
                        self._clear_joining(entry.path, now)
                        continue
                    named = _NAME.fullmatch(name)
                    if named is None or named[2] == self.ident:
                        continue
                    alive = self._alive(Path(entry.path))  # (a dead one is removed)
                    others += alive and named[1] == self.namespace
        except OSError:
            return others
        return others

    def _alive(self, path: Path) -> bool:
        """Whether a process holds the member's file at `path`; a dead member's is removed
        (by a writable tier)."""
        fd = open_regular(path, create=False, writable=False)
        if fd is None:
            return False
        try:
            if not lock(fd, exclusive=False):
                return True  # held: a live member
            if self.join and same_file(fd, path):
                try:
                    os.unlink(path)
                except OSError as e:
                    if e.errno != errno.ENOENT:
                        log.debug("tier %r: cannot remove %s: %s", self.name, path, e)
            return False
        finally:
            os.close(fd)

    def _clear_joining(self, path: str, now: float) -> None:
        if not self.join:
            return
        try:
            if now - os.lstat(path).st_mtime > _JOINING_MAX_AGE:
                os.unlink(path)
        except OSError:
            pass

    def leave(self) -> None:
        """Give the member's file back (at close)."""
        if self._mine is not None:
            self._mine.close(remove=True)
            self._mine = None
