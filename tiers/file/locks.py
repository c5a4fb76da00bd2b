"""Any thread: kvtier's own small files beside a file tier's objects (the `.kvtier` directory of
a `files` directory, a segment directory's writer lock), opened so that nothing planted in
their place can hang or crash a tier, and locked with `flock` for a bounded time.

What a stranger (or a crash) can leave where such a file belongs, and what happens to it:

- a symlink: never followed (`O_NOFOLLOW`); a writable tier removes the link (not its target)
  and makes the file;
- a FIFO or a device: opened without blocking (`O_NONBLOCK`) and refused by `fstat`; a writable
  tier removes it and makes the file;
- a directory: removed when empty, else moved aside whole (nothing in it is destroyed);
- garbage, or a huge file: the caller reads a bounded prefix and judges it (`Ledger`);
- a lock another process holds for ever (a stopped process): every wait is bounded;
- a regular file this process may not open as asked (another user's, read-only, immutable, on
  a read-only mount: `REFUSED`): never removed or replaced, whoever else writes the directory;
  the caller has none (a writable `files` tier then fails its start: `Ledger.check`).

`flock` locks belong to an open file description: the kernel releases one when its holder's
last descriptor closes, however the holder dies. Threads of one process sharing a descriptor
all hold its lock, so in-process callers serialize on a `threading.Lock` too (`Ledger`). A
forked child closes the descriptors of locks its parent holds (`HeldFile`) without unlocking
them: the parent's lock stays its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
import weakref
from pathlib import Path

__all__ = [
    "META",
    "REFUSED",
    "HeldFile",
    "holder_line",
    "lock",
    "meta_dir",
    "open_regular",
    "read_holder",
    "same_file",
    "unlock",
]

META = ".kvtier"
"""The directory of kvtier's own files under a `files` directory (never a namespace: those
are 32 hex digits)."""
REFUSED = frozenset((errno.EACCES, errno.EPERM, errno.EROFS))
"""What the kernel answers a process that may not open a file as it asks: another user's,
read-only, immutable, on a read-only mount."""
_HOLDER_BYTES = 512
"""The most of a holder record a reader reads."""


def meta_dir(base: Path, *, create: bool) -> Path | None:
    """`<base>/.kvtier` when it is a real directory (made when `create`: anything but a
    directory in its place, a symlink included, is removed first); None when it is absent and
    not made, or unusable."""
    path = base / META
    for _ in range(3):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                continue  # made (or planted) meanwhile: look again
            except OSError:
                return None
            return path
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return path
        if not create:
            return None
        try:
            os.unlink(path)  # a file, link or FIFO where kvtier's directory belongs
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


def open_regular(path: Path, *, create: bool, writable: bool | None = None) -> int | None:
    """A descriptor of the regular file at `path`, opened without following a symlink or
    blocking, close-on-exec; with `create`, made when absent (mode 0644) and anything but a
    regular file in its place replaced (`_remove_odd`). None when there is none to be
    had. `writable` (default: `create`): opened for reading and
    writing."""
    writable = create if writable is None else writable
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_RDWR if writable else os.O_RDONLY
    for _ in range(3):
        try:
            fd = os.open(path, flags | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in REFUSED:  # another user's file, or read-only: never replaced
                return None
            # ELOOP: a symlink; ENXIO: a FIFO or socket opened for writing with no reader;
            # EISDIR: a directory
            if not create or not _remove_odd(path):
                return None
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            os.close(fd)
            return None
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        if not create or not _remove_odd(path):
            return None
    return None


def _remove_odd(path: Path) -> bool:
    """Remove what is at `path` (a directory with something in it is moved aside, whole, to
    `<name>.odd-<random>`); whether the way is clear."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
        elif os.listdir(path):
            os.rename(path, path.with_name(f"{path.name}.odd-{os.urandom(4).hex()}"))
        else:
            os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (not removed or replaced since)."""
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def lock(fd: int, *, exclusive: bool = True, wait: float = 0.0) -> bool:
    """`flock` on `fd`, trying for at most `wait` seconds; whether it is held."""
    how = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    deadline = time.monotonic() + wait
    pause = 0.0002
    while True:
        try:
            fcntl.flock(fd, how)
            return True
        except BlockingIOError:
            pass
        except OSError:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.005)


def unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass


def holder_line(what: str = "") -> str:
    """The record a lock's holder writes into its file: who holds it, from when."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-._")[:64]
    return f"pid={os.getpid()} host={host or '?'} started={started}{' ' + what if what else ''}\n"


def read_holder(path: Path) -> str:
    """What the holder of the lock file at `path` recorded, as one printable phrase ("pid 12
    on host h since 2026-12-03T10:00:00Z"); "an unknown holder" when it cannot be read."""
    fd = open_regular(path, create=False)
    if fd is None:
        return "an unknown holder"
    try:
        raw = os.pread(fd, _HOLDER_BYTES, 0)
    except OSError:
        return "an unknown holder"
    finally:
        os.close(fd)
    fields: dict[str, str] = {}
    for token in raw.decode("ascii", "replace").split():
        name, _, value = token.partition("=")
        if name in ("pid", "host", "started") and value:
            fields[name] = "".join(c for c in value if c.isprintable())[:64]
    if "pid" not in fields:
        return "an unknown holder"
    where = f" on host {fields['host']}" if "host" in fields else ""
    since = f" since {fields['started']}" if "started" in fields else ""
    return f"pid {fields['pid']}{where}{since}"


class HeldFile:
    """Any thread: a file whose `flock` this process holds for as long as the object lives
    (a member's file, the sweeper's lock, a segment directory's writer lock). `close` releases
    the lock; a forked child forgets the descriptor without unlocking it (the lock is the
    parent's)."""

    _held: weakref.WeakSet[HeldFile] = weakref.WeakSet()

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path
        self._pid = os.getpid()
        HeldFile._held.add(self)

    def record(self, line: str) -> None:
        """Write who holds the lock into the file (for the error another process shows)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, line.encode("ascii", "replace"), 0)
        except OSError:
            pass

    @property
    def still_there(self) -> bool:
        """Whether the locked file is still the one at `path` (nobody removed or replaced
        it: a replaced lock file would let another process lock the new one)."""
        return self.fd is not None and same_file(self.fd, self.path)

    def close(self, *, remove: bool = False) -> None:
        """Release the lock (and, with `remove`, remove the file first, while still holding
        it: a process that opens it then finds it gone)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if os.getpid() != self._pid:  # a forked child: the descriptor only
            os.close(fd)
            return
        if remove and same_file(fd, self.path):
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(fd)

    @classmethod
    def _forget_in_child(cls) -> None:
        for held in list(cls._held):
            fd, held.fd = held.fd, None
            if fd is not None:
                try:
                    os.close(fd)  # without LOCK_UN: the lock stays the parent's
                except OSError:
                    pass


os.register_at_fork(after_in_child=HeldFile._forget_in_child)
