"""The file tier's `files` layout: a file per block on a local (NVMe) file system.

Layout: `<path>/<namespace hex>/<ab>/<cd>/<key hex>.kv`, fanned out by the key's first two
bytes. A write goes to a temporary file in the same directory and is renamed into place, so a
reader sees a whole object or none, and a crash leaves at most a temporary file, removed at the
next start. The index (key -> size, least recently used first) is rebuilt at start by reading
every file's header, so a restart keeps every complete block.

I/O runs in a bounded thread pool. With O_DIRECT (when the file system allows it; probed at
start and said once in the log) objects are written and read through page-aligned buffers and
the payload starts 4 KiB into the file; otherwise through the page cache, reading payloads
straight into the caller's buffer. A free-space guard refuses puts (`TierFull`) before the disk
fills; `capacity` evicts least recently used files.

Over 400 lines: the reads (whole, into a caller's buffer, head only; buffered or O_DIRECT) are
one concept with the writes they mirror, and each is short; splitting them from the tier would
only move `self` into a parameter.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tiering.errors import CorruptObject, TierError, TierFull, TierUnavailable
from tiering.format import REMOVABLE, check_object, decode_header, peek_lengths
from tiering.keys import BlockKey, key_from_hex, key_path
from tiering.options import TierOptions, option
from tiering.tier import Buffer, KeyLike, ObjectInfo, as_key
from tiers.file.base import FileOptions, FileTier, log
from tiers.file.direct import BLOCK, KEPT_BUFFER, is_aligned, round_up, unlink

__all__ = ["TMP_MAX_AGE", "BlockFileTier", "FilesOptions"]

_SUFFIX = ".kv"
TMP_MAX_AGE = 3600.0
"""Seconds after which a start-up scan takes a temporary file for a write that never ended (a
write lasts at most its tier's deadline). Its age, never its writer's pid, decides: a writer in
another container has a pid that means nothing, or another process, in this pid namespace."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FilesOptions(FileOptions):
    """The options of the `files` layout (any thread: a value): those of every layout."""

    layout: str = option("files", choices=("files",), help="A file per block.")


class BlockFileTier(FileTier, layout="files"):
    """Runtime thread (the event loop): the file tier with a file per block under `path`;
    file I/O in the pool's threads. The index is only touched on the loop thread."""

    Options: ClassVar[type[TierOptions]] = FilesOptions
    _objects = "**/*" + _SUFFIX

    def __init__(self, **options: Any) -> None:
        """`options`: those of `FilesOptions`, as `FileTier` says."""
        super().__init__(**options)
        self._index: OrderedDict[BlockKey, int] = OrderedDict()
        self._bytes = 0
        self._tmp = itertools.count()
        self._dirs: set[Path] = set()
        self._rebuild_index()

    # -- start-up -------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Index every complete object under the namespace's directory. Objects that fail
        their header check are not indexed and are listed in `damaged` (for `kvtier verify`);
        a writable tier removes those whose damage is provable (`tiering.format.REMOVABLE`)
        and leaves another format version's or codec's (a newer kvtier beside this one). A
        temporary file is removed only once it is older than `TMP_MAX_AGE`: several processes,
        in other pid namespaces (containers) too, may be writing here."""
        found: list[tuple[float, BlockKey, int]] = []
        if not self.root.is_dir():
            return
        for path in self.root.rglob("*"):
            try:
                if not path.is_file():
                    continue
                if path.name.endswith(".tmp"):
                    if not self.read_only and _abandoned(path, time.time()):
                        path.unlink(missing_ok=True)  # a write that never finished
                    continue
                if not path.name.endswith(_SUFFIX):
                    continue
                st = path.stat()
                key = key_from_hex(path.name[: -len(_SUFFIX)])
                if path != self._path(key):  # elsewhere than its key's place: never read
                    raise CorruptObject("key", f"{path.name} lies outside its key's directory")
                with open(path, "rb") as f:
                    raw = f.read(BLOCK)
                header = decode_header(raw, key, self.namespace)
                check_object(header, _object_size(raw, st.st_size))
            except (CorruptObject, ValueError) as e:
                reason = getattr(e, "reason", "key")
                removed = not self.read_only and reason in REMOVABLE
                where = str(path.relative_to(self.base))
                self._damaged_at_start(where, reason, str(e), removed=removed)
                if removed:
                    path.unlink(missing_ok=True)
                continue
            except OSError as e:  # gone meanwhile (another writer), or unreadable: not indexed
                log.warning("tier %r: cannot read %s at start: %s", self.name, path, e)
                continue
            found.append((st.st_mtime, key, header.object_length))
        for _, key, size in sorted(found, key=lambda item: item[0]):
            self._index[key] = size
            self._bytes += size
        if found:
            log.info(
                "tier %r: %d blocks (%d bytes) found in %s",
                self.name,
                len(found),
                self._bytes,
                self.root,
            )

    # -- primitives -----------------------------------------------------------------------------

    def _path(self, key: BlockKey) -> Path:
        return self.root / (key_path(key) + _SUFFIX)

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        blob = await self._run(self._read_file, self._path(key), limit)
        if blob is not None:
            self._touch(key)
        return blob

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        got = await self._run(self._read_file_into, self._path(key), payload, limit)
        if got is not None:
            self._touch(key)
        return got

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        return await self._run(self._read_file_head, self._path(key), n)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        size = sum(len(p) for p in parts)
        await self._make_room(size, size - self._index.get(key, 0))
        await self._run(self._write_file, self._path(key), parts, size)
        self._add_to_index(key, size)

    async def _delete(self, key: BlockKey) -> bool:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size
        removed = await self._run(unlink, self._path(key))
        return removed or size is not None

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        for key in list(self._index):
            try:
                st = await self._run(os.stat, self._path(key))
            except FileNotFoundError:
                continue
            yield ObjectInfo(key, st.st_size, st.st_mtime)

    # -- batches: one thread hop per group of blocks ----------------------------------------------

    async def get_many(
        self, items: Sequence[tuple[KeyLike, memoryview | bytearray]]
    ) -> list[bool | BaseException]:
        """Reads in at most `concurrency` groups, each group in one pool call (a hop between
        threads costs about as much as reading a 256 KiB block: BENCHMARKS.md, "Secondary tiers
        against raw baselines"); verified on the loop."""
        if len(items) < 2 or self.codec != "raw":
            return await super().get_many(items)
        blocks = [as_key(k) for k, _ in items]
        views = [memoryview(buffer).cast("B") for _, buffer in items]
        jobs = [(self._path(block), view, block) for block, view in zip(blocks, views, strict=True)]
        answers = await self._in_groups(self._read_and_verify, jobs)
        return await self._finish_reads(blocks, views, answers, lambda i: self._touch(blocks[i]))

    async def put_many(
        self, items: Sequence[tuple[KeyLike, Buffer | bytearray]]
    ) -> list[None | BaseException]:
        """Writes in at most `concurrency` groups, each group in one pool call."""
        if len(items) < 2 or self.read_only:
            return await super().put_many(items)
        encoded, sizes, results, todo = self._encode_batch(items)
        if self.capacity is not None:
            growth = sum(sizes[i] - self._index.get(encoded[i][0], 0) for i in todo)
            await self._evict_for(min(growth, self.capacity))
        jobs = [(self._path(encoded[i][0]), encoded[i][1], sizes[i]) for i in todo]
        for i, outcome in zip(todo, await self._in_groups(self._write_group, jobs), strict=True):
            if outcome is None:
                self._add_to_index(encoded[i][0], sizes[i])
                self._count_put(None, len(items[i][1]))
            else:
                self.counters["errors"] += 1
                results[i] = outcome
        return results

    def _read_and_verify(self, jobs: list[tuple[Path, memoryview, BlockKey]]) -> list[Any]:
        """Each block read into its view and checked there, in the pool (its `Header`), each
        block as soon as it is in: the loop then only counts, and the checks of one group
        overlap the reads of the others."""
        out: list[Any] = []
        for path, view, block in jobs:
            try:
                answer = self._read_file_into(path, view, self.object_limit(len(view)))
                if answer is not None and answer[1]:
                    out.append(self.verify_placed(block, answer[0], view))
                else:
                    out.append(answer)
            except (TierError, CorruptObject) as e:
                out.append(e)
        return out

    def _write_group(self, jobs: list[tuple[Path, Sequence[Buffer], int]]) -> list[Any]:
        out: list[Any] = []
        for path, parts, size in jobs:
            try:
                self._write_file(path, parts, size)
                out.append(None)
            except TierError as e:
                out.append(e)
        return out

    # -- bookkeeping on the loop thread ---------------------------------------------------------

    def _bytes_used(self) -> int:
        return self._bytes

    def _add_to_index(self, key: BlockKey, size: int) -> None:
        """Record a written object (the most recently used)."""
        self._bytes += size - self._index.pop(key, 0)
        self._index[key] = size

    def _touch(self, key: BlockKey) -> None:
        if key in self._index:
            self._index.move_to_end(key)

    async def _evict_for(self, size: int) -> None:
        assert self.capacity is not None
        victims = []
        while self._index and self._bytes + size > self.capacity:
            key, freed = self._index.popitem(last=False)
            self._bytes -= freed
            victims.append(key)
        for key in victims:
            await self._run(unlink, self._path(key))
            self.counters["evictions"] += 1

    # -- file I/O, in the pool -------------------------------------------------------------------

    def _open_for_read(self, path: Path, direct: bool) -> int | None:
        """A descriptor of the regular file at `path` (None: none there). Anything else put
        in its place (a FIFO, which would block the thread forever; a device; a directory) is
        `CorruptObject`: opened without blocking, and refused before a byte is read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECT if direct else 0))
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
        whole blocks) before anything is read: a sparse file may claim any size."""
        size = os.fstat(fd).st_size
        if size > round_up(limit):
            raise CorruptObject("length", f"{path} holds {size} bytes, at most {limit} expected")
        return size

    def _read_file(self, path: Path, limit: int) -> Buffer | None:
        fd = self._open_for_read(path, self.direct)
        if fd is None:
            return None
        try:
            size = self._size(fd, path, limit)
            if not self.direct:
                data = os.pread(fd, size, 0)
                return data[: _object_size(data, size)]
            rounded = max(round_up(size), BLOCK)
            buffer = self._aligned_buffer(rounded)
            n = min(os.preadv(fd, [buffer], 0), size)
            whole = buffer[: min(n, _object_size(buffer[:n], size))]
            # a kept bounce buffer is reused by this thread's next call: copied; a large one
            # is this call's own (an operator's read of a large block: no second copy)
            return whole if rounded > KEPT_BUFFER else bytes(whole)
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _read_file_head(self, path: Path, n: int) -> tuple[bytes, int] | None:
        fd = self._open_for_read(path, False)
        if fd is None:
            return None
        try:
            head = os.pread(fd, n, 0)
            return head, _object_size(head, os.fstat(fd).st_size)
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _read_file_into(
        self, path: Path, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        """The header, the payload read straight into `payload` (buffered I/O) or through an
        aligned buffer (O_DIRECT), when the file is laid out as a header and exactly that
        payload; otherwise the whole file (`ReadsInto`)."""
        if self.direct:
            return self._read_direct_into(path, payload, limit)
        fd = self._open_for_read(path, False)
        if fd is None:
            return None
        try:
            size = self._size(fd, path, limit)
            header = os.pread(fd, min(BLOCK, size), 0)
            offset = _placed_at(header, size, len(payload))
            if offset is None or offset > len(header):
                data = os.pread(fd, size, 0)
                return data[: _object_size(data, size)], False
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
        fd = self._open_for_read(path, True)
        if fd is None:
            return None
        try:
            size = self._size(fd, path, limit)
            header = self._aligned_buffer(BLOCK)
            if is_aligned(payload) and size == BLOCK + len(payload):  # (no padding then)
                # a primary slot, and a file of the right size: DMA straight into it
                n = os.preadv(fd, [header, payload], 0)
                if n < size:
                    raise CorruptObject("truncated", f"{path} is shorter than its header says")
                if _placed_at(header, size, len(payload)) == BLOCK:
                    return bytes(header), True
            buffer = self._aligned_buffer(max(round_up(size), BLOCK))
            n = min(os.preadv(fd, [buffer], 0), size)
            offset = _placed_at(buffer[:n], size, len(payload))
            if offset is None or n < size:  # the whole object (short, if the file is)
                return bytes(buffer[: min(n, _object_size(buffer[:n], size))]), False
            payload[:] = buffer[offset : offset + len(payload)]
            return bytes(buffer[:offset]), True
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _write_file(self, path: Path, parts: Sequence[Buffer], size: int) -> None:
        self._check_free(size)
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(self._tmp)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags(), 0o644)
            try:
                buffers = self._gather(parts, size)
                written = os.writev(fd, buffers)
                if written != sum(len(b) for b in buffers):
                    raise OSError(errno.EIO, f"short write ({written} of {size})")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            if self.fsync:
                dir_fd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"tier {self.name!r}: disk full writing {path}") from e
            raise TierUnavailable(
                f"tier {self.name!r}: cannot write {path}: {e.strerror or e}"
            ) from e


def _object_size(head: Buffer, size: int) -> int:
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
    if lengths is None or lengths[1] != length or _object_size(header, size) != lengths[0] + length:
        return None
    return lengths[0]


def _regular(path: Path) -> bool:
    """Whether `path` is a regular file (or gone: an ordinary miss, not a planted oddity)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True


def _abandoned(path: Path, now: float) -> bool:
    """Whether a temporary file is older than `TMP_MAX_AGE` (its write never ended)."""
    try:
        return now - path.stat().st_mtime > TMP_MAX_AGE
    except FileNotFoundError:
        return False
