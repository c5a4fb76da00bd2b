"""The `files` layout's file I/O (the tier's pool threads): reading an object whole, its head,
or its payload straight into a caller's buffer (buffered, or O_DIRECT through aligned buffers),
writing one once, and what a shared directory asks of both (room reserved before a write,
recency refreshed on a hit, removals counted).

Anything but a regular file where an object belongs (a FIFO, which would block a thread for
ever; a device; a directory) is `CorruptObject("magic")`, refused before a byte is read; a
file larger than the caller's object can be is `CorruptObject("length")`, refused unread.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tiering.errors import CorruptObject, TierFull, TierUnavailable
from tiering.tier import Buffer
from tiering.tier.format import peek_lengths
from tiers.file.direct import BLOCK, KEPT_BUFFER, BounceBuffers, is_aligned, round_up
from tiers.file.once import place_once
from tiers.file.shared import SharedDirectory

__all__ = ["BlockFiles", "object_size"]


class BlockFiles:
    """A `files` tier's reads and writes of object files (its pool threads; nothing here
    touches the tier's index)."""

    def __init__(
        self,
        *,
        name: str,
        direct: bool,
        fsync: bool,
        buffers: BounceBuffers,
        check_free: Callable[[int], None],
        gather: Callable[[Sequence[Buffer], int], list[Buffer]],
        shared: SharedDirectory,
        recency: bool,
    ) -> None:
        """`recency`: set a file's mtime when it is written and read (the sweeper removes the
        least recently used first: a tier with a capacity that writes)."""
        self.name = name
        self.direct = direct
        self.fsync = fsync
        self.shared = shared
        self.recency = recency
        self._buffers = buffers
        self._check_free = check_free
        self._gather = gather
        self._tmp = itertools.count()
        self._tag = os.urandom(8).hex()
        self._dirs: set[Path] = set()

    # -- reads ------------------------------------------------------------------------------------

    def open_for_read(self, path: Path, direct: bool) -> int | None:
        """A descriptor of the regular file at `path` (None: none there). Anything else put
        in its place (a FIFO, which would block the thread forever; a device; a directory; a
        symbolic link, never followed: a read's recency stamp must not reach its target) is
        `CorruptObject`: opened without blocking, and refused before a byte is read."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as e:
            if not _regular(path):  # a FIFO or device refuses O_DIRECT: the object's fault
                raise CorruptObject("magic", f"{path} is not a regular file") from None
            raise TierUnavailable(f"tier {self.name!r}: cannot open {path}: {e.strerror}") from e
        try:
            mode = os.fstat(fd).st_mode
        except OSError as e:
            os.close(fd)
            raise TierUnavailable(f"tier {self.name!r}: cannot stat {path}: {e.strerror}") from e
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise CorruptObject("magic", f"{path} is not a regular file")
        return fd

    def _size(self, fd: int, path: Path, limit: int) -> int:
        """The file's size, checked against `limit` (and the padding O_DIRECT writes add to
        whole blocks) before anything is read: a sparse file may claim any size. A read of
        an object is a use: its mtime becomes now (`recency`)."""
        size = os.fstat(fd).st_size
        if size > round_up(limit):
            raise CorruptObject("length", f"{path} holds {size} bytes, at most {limit} expected")
        if self.recency:
            _touch(fd)
        return size

    def read(self, path: Path, limit: int) -> Buffer | None:
        fd = self.open_for_read(path, self.direct)
        if fd is None:
            return None
        try:
            size = self._size(fd, path, limit)
            if not self.direct:
                data = os.pread(fd, size, 0)
                return data[: object_size(data, size)]
            rounded = max(round_up(size), BLOCK)
            buffer = self._buffers.get(rounded)
            n = min(os.preadv(fd, [buffer], 0), size)
            whole = buffer[: min(n, object_size(buffer[:n], size))]
            # a kept bounce buffer is reused by this thread's next call: copied; a large one
            # is this call's own (an operator's read of a large block: no second copy)
            return whole if rounded > KEPT_BUFFER else bytes(whole)
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def read_head(self, path: Path, n: int) -> tuple[bytes, int] | None:
        fd = self.open_for_read(path, False)
        if fd is None:
            return None
        try:
            head = os.pread(fd, n, 0)
            return head, object_size(head, os.fstat(fd).st_size)
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def read_into(self, path: Path, payload: memoryview, limit: int) -> tuple[Buffer, bool] | None:
        """The header, the payload read straight into `payload` (buffered I/O) or through an
        aligned buffer (O_DIRECT), when the file is laid out as a header and exactly that
        payload; otherwise the whole file (`ReadsInto`)."""
        if self.direct:
            return self._read_direct_into(path, payload, limit)
        fd = self.open_for_read(path, False)
        if fd is None:
            return None
        try:
            size = self._size(fd, path, limit)
            header = os.pread(fd, min(BLOCK, size), 0)
            offset = _placed_at(header, size, len(payload))
            if offset is None or offset > len(header):
                data = os.pread(fd, size, 0)
                return data[: object_size(data, size)], False
            if os.preadv(fd, [payload], offset) != len(payload):
                raise CorruptObject("truncated", f"{path} is shorter than its header says")
            return header[:offset], True
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _read_direct_into(
        self, path: Path, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        fd = self.open_for_read(path, True)
        if fd is None:
            return None
        try:
            size = self._size(fd, path, limit)
            header = self._buffers.get(BLOCK)
            if is_aligned(payload) and size == BLOCK + len(payload):  # (no padding then)
                # a primary slot, and a file of the right size: DMA straight into it
                n = os.preadv(fd, [header, payload], 0)
                if n < size:
                    raise CorruptObject("truncated", f"{path} is shorter than its header says")
                if _placed_at(header, size, len(payload)) == BLOCK:
                    return bytes(header), True
            buffer = self._buffers.get(max(round_up(size), BLOCK))
            n = min(os.preadv(fd, [buffer], 0), size)
            offset = _placed_at(buffer[:n], size, len(payload))
            if offset is None or n < size:  # the whole object (short, if the file is)
                return bytes(buffer[: min(n, object_size(buffer[:n], size))]), False
            payload[:] = buffer[offset : offset + len(payload)]
            return bytes(buffer[:offset]), True
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    # -- writes -----------------------------------------------------------------------------------

    def write(self, path: Path, parts: Sequence[Buffer], size: int) -> bool:
        """Write the object of `size` bytes in `parts` to `path` once: False, writing nothing,
        when a file is there already (another engine's, or this one's), or is put there while
        this one is written (`place_once`). Room is reserved first (`TierFull` without it).
        A file found there is used by this write as a read would use it (`recency`: its mtime
        becomes now, in the same one call that finds it), so the sweeper sees every engine that
        stores the block, not only the first."""
        if _touched(path) if self.recency else _exists(path):
            return False
        disk = round_up(size) if self.direct else size
        self.shared.take(disk)
        try:
            placed = self._write_new(path, parts, size)
        except BaseException:
            self.shared.give(disk)
            raise
        if placed:
            self.shared.landed(disk)
        else:
            self.shared.give(disk)
        return placed

    def _write_new(self, path: Path, parts: Sequence[Buffer], size: int) -> bool:
        self._check_free(size)
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        # Named by this writer's random tag, not its pid: a writer in another pid namespace (a
        # container) may have the same pid and the same count, and its file is never ours.
        tmp = path.with_name(f".{path.name}.{self._tag}.{next(self._tmp)}.tmp")
        created = False
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0),
                0o644,
            )
            created = True
            try:
                buffers = self._gather(parts, size)
                written = os.writev(fd, buffers)
                if written != sum(len(b) for b in buffers):
                    raise OSError(errno.EIO, f"short write ({written} of {size})")
                if self.recency:
                    _touch(fd)  # to the nanosecond: the kernel's own stamp is coarser
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            placed = place_once(tmp, path)
            if placed and self.fsync:
                dir_fd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            return placed
        except OSError as e:
            if created:  # (a name taken by another writer is left to it)
                tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"tier {self.name!r}: disk full writing {path}") from e
            raise TierUnavailable(
                f"tier {self.name!r}: cannot write {path}: {e.strerror or e}"
            ) from e

    # -- what a shared directory asks ----------------------------------------------------------

    def sizes(self, paths: Sequence[Path]) -> list[int | None]:
        """The size of each regular file among `paths`, None where there is none (an
        existence check: one pool call for a batch of keys)."""
        out: list[int | None] = []
        for path in paths:
            try:
                st = os.lstat(path)  # a link in an object's place is no object
            except OSError:
                out.append(None)
                continue
            out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
        return out

    def remove(self, path: Path) -> bool:
        """Remove the object file at `path` (counted out of the directory's bytes); whether
        there was one."""
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot remove {path}: {e.strerror}") from e
        self.shared.removed(size)
        return True

    def remove_if(self, path: Path, seen: bytes) -> bool:
        """Remove the object file at `path` only while it begins with `seen` (the object a
        read refused); whether it did. The file is first moved aside under a temporary name
        of this writer's (one atomic rename: no writer can change it there), compared, and
        put back when it is another object (unless one was written under the name
        meanwhile, which then stays)."""
        aside = path.with_name(f".{path.name}.{self._tag}.{next(self._tmp)}.tmp")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot remove {path}: {e.strerror}") from e
        try:
            st = os.lstat(aside)
            head = b""
            if stat.S_ISREG(st.st_mode):
                with open(aside, "rb") as f:
                    head = f.read(len(seen))
            if head != seen:
                place_once(aside, path)
                return False
            os.unlink(aside)
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot remove {path}: {e.strerror}") from e
        self.shared.removed(st.st_size)
        return True


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True


def _touched(path: Path) -> bool:
    """Whether something is at `path`, its mtime (and atime) set to now if so: one
    `utimensat`, where a write's existence check is one `lstat`. A link is not followed (its
    own times change: no object's). Where the times cannot be set (another user's file), the
    kernel's coarser now, or none (the file is then judged by its last write)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now), follow_symlinks=False)
    except FileNotFoundError:
        return False
    except PermissionError:
        try:
            os.utime(path, follow_symlinks=False)
        except OSError:
            pass
    except OSError:
        return _exists(path)
    return True


def _touch(fd: int) -> None:
    """Set the file's mtime (and atime) to now, to the nanosecond; as the kernel's coarser
    now where the times cannot be given (a file another user owns); not at all where neither
    is allowed (the file is then judged by its last write)."""
    now = time.time_ns()
    try:
        os.utime(fd, ns=(now, now))
    except PermissionError:
        try:
            os.utime(fd)
        except OSError:
            pass
    except OSError:
        pass


def object_size(head: Buffer, size: int) -> int:
    """The length of the object in a file of `size` bytes that starts with `head`: what its
    (unverified) header says when the rest is the zero padding O_DIRECT writes add up to a
    whole block, else the file's size (which then fails the tier's check of the object)."""
    lengths = peek_lengths(head)
    if lengths is None:
        return size
    end = lengths[0] + lengths[1]
    return end if end <= size and (size == end or size == round_up(end)) else size


def _placed_at(header: Buffer, size: int, length: int) -> int | None:
    """Where the payload of an object in a file of `size` bytes starts, if its (unverified)
    header says it is a header followed by exactly `length` bytes; else None."""
    lengths = peek_lengths(header)
    if lengths is None or lengths[1] != length or object_size(header, size) != lengths[0] + length:
        return None
    return lengths[0]


def _regular(path: Path) -> bool:
    """Whether `path` is a regular file, not a link to one (or gone: an ordinary miss, not a
    planted oddity)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return True
