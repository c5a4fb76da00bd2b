"""The file tier: blocks as files on a local (NVMe) file system.

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
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from tiering.errors import ConfigError, TierError, TierFull, TierTimeout, TierUnavailable
from tiering.format import Corrupt, check_object, decode_header, peek_lengths
from tiering.keys import BlockKey, key_from_hex, key_path
from tiering.tier import Buffer, KeyLike, ObjectInfo, Tier, TierStat, as_key
from tiering.units import parse_size
from tiers.threads import IOThreads

__all__ = ["FileTier"]

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOCK = 4096
_KEPT_BUFFER = 64 << 20
"""The largest bounce buffer a pool thread keeps for its next call."""
LAYOUTS = ("files", "segments")
_SUFFIX = ".kv"
_said_buffered: set[str] = set()


class FileTier(Tier):
    """Blocks as files under `path`. Runs on the runtime's event loop; file I/O in a pool of
    `concurrency` threads. The index is only touched on the loop thread."""

    type_name = "file"
    persistent = True
    supports_listing = True
    evicts = True
    align = BLOCK
    indexed = True
    """The index is this process's: blocks another process writes into the same directory
    meanwhile are found at the next start."""

    _objects = "**/*" + _SUFFIX
    """Where a namespace directory's objects are (relative glob)."""
    _removes_damaged: ClassVar[bool] = True
    """A writable tier's start-up scan removes the damaged objects it finds."""

    def __new__(cls, *args: Any, layout: str = "files", **options: Any) -> FileTier:
        if cls is FileTier and layout == "segments":
            from tiers.segments import SegmentFileTier

            cls = SegmentFileTier
        return super().__new__(cls)

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        min_free: int | str = "1GiB",
        direct: bool | None = None,
        fsync: bool = False,
        layout: str = "files",
        segment_size: int | str = "64MiB",
        aio: bool = True,
        **options: Any,
    ) -> None:
        """`min_free`: puts fail (`TierFull`) rather than leave less free space on the disk.
        `direct`: use O_DIRECT (None: when the file system supports it). `fsync`: flush each
        object and its directory before acknowledging the put (survives power loss, slower).
        `layout`: `files` (a file per block) or `segments` (blocks appended to files of
        `segment_size`, `tiers.segments`: one system call per block, no file created per
        block; evicts a segment at a time). `aio`: with `segments` and O_DIRECT, reads and
        writes go to the disk by Linux kernel AIO from the event loop where the kernel and file
        system allow (`tiers.aio`), instead of through the thread pool."""
        if layout not in LAYOUTS:
            raise ConfigError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
        super().__init__(**options)
        self.base = Path(path)
        self.root = self.base / self.namespace.hex()  # made on the first write
        if not self.read_only:  # a read-only tier creates, renames and deletes nothing
            try:
                self.base.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"tier {self.name!r}: path {path}: cannot create: {e.strerror}"
                ) from e
        elif self.base.exists() and not self.base.is_dir():
            raise ConfigError(f"tier {self.name!r}: path {path} is not a directory")
        self.min_free = parse_size(min_free, "min_free") if min_free else 0
        self.fsync = fsync
        self.aio = aio
        if direct is None:
            if self.read_only:
                direct = _direct_readable(self.root, self._objects)
            else:
                direct = _direct_supported(self.base)
        self.direct = direct
        if not self.direct and str(self.base) not in _said_buffered:
            _said_buffered.add(str(self.base))
            log.info(
                "tier %r: %s does not support O_DIRECT; using buffered I/O", self.name, self.base
            )
        self._pool = IOThreads(self.concurrency, f"kvtier-{self.name}")
        self._index: OrderedDict[BlockKey, int] = OrderedDict()
        self._bytes = 0
        self._tmp = itertools.count()
        self._buffers = threading.local()  # one aligned bounce buffer per pool thread
        self._dirs: set[Path] = set()
        self._rebuild_index()

    # -- start-up -------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Index every complete object under the namespace's directory. Objects that fail
        their header check are not indexed: removed by a writable tier, left in place by a
        read-only one, and listed in `damaged` either way (for `kvtier verify`). A temporary
        file is removed only when its writer is gone (several processes may write here)."""
        found: list[tuple[float, BlockKey, int]] = []
        if not self.root.is_dir():
            return
        for path in self.root.rglob("*"):
            try:
                if not path.is_file():
                    continue
                if path.name.endswith(".tmp"):
                    if not self.read_only and _abandoned(path):
                        path.unlink(missing_ok=True)  # a write that never finished
                    continue
                if not path.name.endswith(_SUFFIX):
                    continue
                st = path.stat()
                key = key_from_hex(path.name[: -len(_SUFFIX)])
                if path != self._path(key):  # elsewhere than its key's place: never read
                    raise Corrupt("key", f"{path.name} lies outside its key's directory")
                with open(path, "rb") as f:
                    raw = f.read(BLOCK)
                header = decode_header(raw, key, self.namespace)
                check_object(header, _object_size(raw, st.st_size))
            except (Corrupt, ValueError) as e:
                reason = getattr(e, "reason", "key")
                self._damaged_at_start(str(path.relative_to(self.base)), reason, str(e))
                if not self.read_only:
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

    def _damaged_at_start(self, where: str, reason: str, detail: str) -> None:
        self.counters[f"corrupt.{reason}"] += 1
        self.damaged.append((where, reason, not self.read_only and self._removes_damaged))
        verb = "leaving" if self.read_only else "removing"
        log.warning("tier %r: %s a damaged object at start, %s: %s", self.name, verb, where, detail)

    # -- primitives -----------------------------------------------------------------------------

    def _path(self, key: BlockKey) -> Path:
        return self.root / (key_path(key) + _SUFFIX)

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        """`function` in the pool. Cancelled (a deadline), it still waits for the thread: the
        thread reads into and writes from the caller's buffers (primary slots), which must not
        be handed to anyone else while it runs. The caller's deadline comes late instead."""
        return await self._pool.run_to_end(function, *args)

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
        self._indexed(key, size)

    async def _delete(self, key: BlockKey) -> bool:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size
        removed = await self._run(_unlink, self._path(key))
        return removed or size is not None

    def knows(self, key: BlockKey) -> bool:
        return key in self._index

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self._index for key in keys]

    async def _stat(self) -> TierStat:
        return TierStat(len(self._index), self._bytes, self.capacity)

    async def _list(self) -> AsyncIterator[BlockKey]:
        for key in list(self._index):
            yield key

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        for key in list(self._index):
            try:
                st = await self._run(os.stat, self._path(key))
            except FileNotFoundError:
                continue
            yield ObjectInfo(key, st.st_size, st.st_mtime)

    async def _namespaces(self) -> list[bytes]:
        found: list[bytes] = []
        if not self.base.is_dir():  # a read-only tier over a directory not made yet
            return found
        for entry in self.base.iterdir():
            if entry.is_dir() and len(entry.name) == 32 and any(entry.glob(self._objects)):
                try:
                    found.append(bytes.fromhex(entry.name))
                except ValueError:
                    continue
        return sorted(found)

    async def _close(self) -> None:
        self._pool.shutdown()

    # -- batches: one thread hop per group of blocks ----------------------------------------------

    async def get_many(
        self, items: Sequence[tuple[KeyLike, memoryview | bytearray]]
    ) -> list[bool | BaseException]:
        """Reads in at most `concurrency` groups, each group in one pool call (a hop between
        threads costs more than reading a 256 KiB block here); verified on the loop."""
        if len(items) < 2 or self.codec != "raw":
            return await super().get_many(items)
        blocks = [as_key(k) for k, _ in items]
        views = [memoryview(buffer).cast("B") for _, buffer in items]
        jobs = [(self._path(block), view) for block, view in zip(blocks, views, strict=True)]
        answers = await self._in_groups(self._read_group, jobs)
        return await self._finish_reads(blocks, views, answers, lambda i: self._touch(blocks[i]))

    async def _finish_reads(
        self,
        blocks: list[BlockKey],
        views: list[memoryview],
        answers: list[Any],
        touch: Callable[[int], None],
    ) -> list[bool | BaseException]:
        """Each batch read's answer (what `_read_into` returns, or an error) verified,
        counted and refused where corrupt, as a single read's; `touch(i)` for each block
        found."""
        results: list[bool | BaseException] = []
        for i, (block, view, answer) in enumerate(zip(blocks, views, answers, strict=True)):
            if isinstance(answer, Corrupt):
                await self._refuse(block, answer)
                results.append(False)
            elif isinstance(answer, BaseException):
                self.counters["errors"] += 1
                results.append(answer)
            else:
                if answer is not None:
                    touch(i)
                results.append(await self._accept_into(block, answer, view))
        return results

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
                self._indexed(encoded[i][0], sizes[i])
                self.counters["puts"] += 1
                self.counters["bytes_written"] += len(items[i][1])
            else:
                self.counters["errors"] += 1
                results[i] = outcome
        return results

    async def _make_room(self, size: int, growth: int) -> None:
        """Evict for an object of `size` that grows the tier by `growth` (with a capacity)."""
        if self.capacity is None:
            return
        if size > self.capacity:
            raise TierFull(f"tier {self.name!r}: an object of {size} bytes exceeds the capacity")
        await self._evict_for(growth)

    def _encode_batch(
        self, items: Sequence[tuple[KeyLike, Buffer | bytearray]]
    ) -> tuple[list[tuple[BlockKey, tuple[Buffer, Buffer]]], list[int], list[Any], list[int]]:
        """The objects of a batch of puts, their sizes, the results so far (objects larger than
        the capacity fail alone) and the indexes of those to write."""
        encoded = [self._encode(k, d) for k, d in items]
        sizes = [sum(len(p) for p in parts) for _, parts in encoded]
        results: list[None | BaseException] = [None] * len(items)
        todo = []
        for i, size in enumerate(sizes):
            if self.capacity is not None and size > self.capacity:
                results[i] = TierFull(
                    f"tier {self.name!r}: an object of {size} bytes exceeds the capacity"
                )
            else:
                todo.append(i)
        return encoded, sizes, results, todo

    async def _in_groups(
        self, work: Callable[[list[Any]], list[Any]], jobs: list[Any]
    ) -> list[Any]:
        """`work` over `jobs` split into at most `concurrency` groups run at once in the pool,
        each under the tier's deadline per job; a group that fails fails each of its jobs."""
        n = min(self.concurrency, len(jobs))
        groups = [jobs[i::n] for i in range(n)]  # interleaved: every group starts at the front

        async def one(group: list[Any]) -> list[Any]:
            try:
                if self.timeout is None:
                    return await self._run(work, group)
                async with asyncio.timeout(self.timeout * len(group)):
                    return await self._run(work, group)
            except TimeoutError:
                error = TierTimeout(f"tier {self.name!r}: no answer within the deadline")
                return [error] * len(group)

        answers: list[Any] = [None] * len(jobs)
        for i, group_answers in enumerate(await asyncio.gather(*(one(g) for g in groups))):
            answers[i::n] = group_answers
        return answers

    def _read_group(self, jobs: list[tuple[Path, memoryview]]) -> list[Any]:
        out: list[Any] = []
        for path, view in jobs:
            try:
                out.append(self._read_file_into(path, view, self.object_limit(len(view))))
            except (TierError, Corrupt) as e:
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

    def _indexed(self, key: BlockKey, size: int) -> None:
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
            await self._run(_unlink, self._path(key))
            self.counters["evictions"] += 1

    # -- file I/O, in the pool -------------------------------------------------------------------

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def _open_for_read(self, path: Path, direct: bool) -> int | None:
        """A descriptor of the regular file at `path` (None: none there). Anything else put
        in its place (a FIFO, which would block the thread forever; a device; a directory) is
        `Corrupt`: opened without blocking, and refused before a byte is read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            if not _regular(path):  # a FIFO or device refuses O_DIRECT: the object's fault
                raise Corrupt("magic", f"{path} is not a regular file") from None
            raise TierUnavailable(f"tier {self.name!r}: cannot open {path}: {e.strerror}") from e
        try:
            mode = os.fstat(fd).st_mode
        except OSError as e:
            os.close(fd)
            raise TierUnavailable(f"tier {self.name!r}: cannot stat {path}: {e.strerror}") from e
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise Corrupt("magic", f"{path} is not a regular file")
        return fd

    def _size(self, fd: int, path: Path, limit: int) -> int:
        """The file's size, checked against `limit` (and the padding O_DIRECT writes add to
        whole blocks) before anything is read: a sparse file may claim any size."""
        size = os.fstat(fd).st_size
        if size > -(-limit // BLOCK) * BLOCK:
            raise Corrupt("length", f"{path} holds {size} bytes, at most {limit} expected")
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
            rounded = max(-(-size // BLOCK) * BLOCK, BLOCK)
            buffer = self._aligned(rounded)
            n = min(os.preadv(fd, [buffer], 0), size)
            whole = buffer[: min(n, _object_size(buffer[:n], size))]
            # a kept bounce buffer is reused by this thread's next call: copied; a large one
            # is this call's own (an operator's read of a large block: no second copy)
            return whole if rounded > _KEPT_BUFFER else bytes(whole)
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
                raise Corrupt("truncated", f"{path} is shorter than its header says")
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
            header = self._aligned(BLOCK)
            if _aligned(payload) and size == BLOCK + len(payload):  # (no padding then)
                # a primary slot, and a file of the right size: DMA straight into it
                n = os.preadv(fd, [header, payload], 0)
                if n < size:
                    raise Corrupt("truncated", f"{path} is shorter than its header says")
                if _placed_at(header, size, len(payload)) == BLOCK:
                    return bytes(header), True
            buffer = self._aligned(max(-(-size // BLOCK) * BLOCK, BLOCK))
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

    def _check_free(self, size: int) -> None:
        fs = os.statvfs(self.base)
        free = fs.f_bavail * fs.f_frsize
        if free - size < self.min_free:
            raise TierFull(
                f"tier {self.name!r}: {free} bytes free on {self.root}; a put of {size} would "
                f"leave less than min_free ({self.min_free})"
            )

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

    def _gather(self, parts: Sequence[Buffer], size: int) -> list[Buffer]:
        """The buffers one write of an object sends: with O_DIRECT, page-aligned and whole
        4 KiB blocks (a primary slot's payload goes as it is, behind an aligned copy of the
        header; anything else through this thread's bounce buffer, zero-padded)."""
        if not self.direct:
            return [memoryview(p) for p in parts]
        if len(parts) == 2 and len(parts[0]) == BLOCK and _aligned(memoryview(parts[1])):
            header = self._aligned(BLOCK)
            header[:] = parts[0]
            return [header, parts[1]]
        buffer = self._aligned(-(-size // BLOCK) * BLOCK)
        at = 0
        for part in parts:
            buffer[at : at + len(part)] = part
            at += len(part)
        buffer[at:] = bytes(len(buffer) - at)  # no stale bytes in the padding
        return [buffer]

    def _aligned(self, size: int) -> memoryview:
        """This thread's page-aligned buffer, `size` bytes of it (grown as needed, reused:
        a fresh mapping per call costs a page fault per 4 KiB)."""
        if size > _KEPT_BUFFER:  # an operator's read of a large block: not kept afterwards
            return memoryview(mmap.mmap(-1, size))[:size]
        mapping: mmap.mmap | None = getattr(self._buffers, "mapping", None)
        if mapping is None or len(mapping) < size:
            mapping = mmap.mmap(-1, max(size, 1 << 20))
            self._buffers.mapping = mapping
        return memoryview(mapping)[:size]

    def raw_path(self, key: BlockKey) -> Path:
        """Where the object of `key` lives (for white-box tests and operators)."""
        return self._path(key)


def _object_size(head: Buffer, size: int) -> int:
    """The length of the object in a file of `size` bytes that starts with `head`: what its
    (unverified) header says when the rest is the zero padding O_DIRECT writes add up to a
    whole block, else the file's size (and the object is refused upstairs)."""
    lengths = peek_lengths(head)
    if lengths is None:
        return size
    end = lengths[0] + lengths[1]
    return end if end <= size and (size == end or size == -(-end // BLOCK) * BLOCK) else size


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


def _abandoned(path: Path) -> bool:
    """Whether a temporary file's writer is gone: its name carries the writer's pid
    (`.<name>.<pid>.<n>.tmp`); one of another host, or of a reused pid, is taken as gone once
    it is an hour old."""
    try:
        pid = int(path.name.rsplit(".", 3)[-3])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return True
    except PermissionError:  # alive, another user's
        pass
    try:
        return time.time() - path.stat().st_mtime > 3600
    except FileNotFoundError:
        return False


def _aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move `view` as it is: page-aligned, whole 4 KiB blocks."""
    if len(view) == 0 or len(view) % BLOCK:
        return False
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % BLOCK == 0


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _direct_readable(root: Path, objects: str) -> bool:
    """Whether the objects under `root` (the glob `objects`) can be read with O_DIRECT, found
    without writing: by reading the first block of one of them so (none: buffered)."""
    for path in root.glob(objects) if root.is_dir() else ():
        if not path.is_file():  # a FIFO would block the open
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_DIRECT)
        except OSError:
            return False
        try:
            os.preadv(fd, [mmap.mmap(-1, BLOCK)], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    return False


def _direct_supported(directory: Path) -> bool:
    probe = directory / f".direct-probe-{os.getpid()}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, BLOCK)
        os.write(fd, buffer)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
