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
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tiering.config import parse_size
from tiering.errors import ConfigError, TierError, TierFull, TierTimeout, TierUnavailable
from tiering.format import Corrupt, decode_header, peek_lengths
from tiering.keys import BlockKey, key_from_hex, key_path
from tiering.tier import Buffer, KeyLike, ObjectInfo, Tier, TierStat, as_key
from tiers.threads import IOThreads

__all__ = ["FileTier"]

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOCK = 4096
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
        try:
            self.base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"tier {self.name!r}: path {path}: cannot create: {e.strerror}"
            ) from e
        self.min_free = parse_size(min_free, "min_free") if min_free else 0
        self.fsync = fsync
        self.aio = aio
        self.direct = _direct_supported(self.base) if direct is None else direct
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
        found: list[tuple[float, BlockKey, int]] = []
        if not self.root.is_dir():
            return
        for path in self.root.rglob("*"):
            if not path.is_file():
                continue
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                key = key_from_hex(path.name[: -len(_SUFFIX)])
                with open(path, "rb") as f:
                    raw = f.read(BLOCK)
                header = decode_header(raw, key, self.namespace)
                stat = path.stat()
                if stat.st_size < header.object_length:
                    raise Corrupt("truncated", f"file of {stat.st_size} bytes")
            except (Corrupt, ValueError) as e:
                reason = getattr(e, "reason", "key")
                self.counters[f"corrupt.{reason}"] += 1
                log.warning("tier %r: removing %s at start: %s", self.name, path, e)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, key, header.object_length))
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

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        """`function` in the pool. Cancelled (a deadline), it still waits for the thread: the
        thread reads into and writes from the caller's buffers (primary slots), which must not
        be handed to anyone else while it runs. The caller's deadline comes late instead."""
        return await self._pool.run_to_end(function, *args)

    async def _read(self, key: BlockKey) -> Buffer | None:
        blob = await self._run(self._read_file, self._path(key))
        if blob is not None:
            self._touch(key)
        return blob

    async def _read_into(self, key: BlockKey, payload: memoryview) -> bytes | None:
        header = await self._run(self._read_file_into, self._path(key), payload)
        if header is not None:
            self._touch(key)
        return header

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
        found = []
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
        """Each batch read's answer (a header, None, or an error) verified, counted and
        refused where corrupt, as a single read's; `touch(i)` for each block found."""
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
                out.append(self._read_file_into(path, view))
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

    def _read_file(self, path: Path) -> Buffer | None:
        try:
            fd = os.open(path, os.O_RDONLY | self._flags())
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot open {path}: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            if not self.direct:
                return os.pread(fd, size, 0)
            buffer = self._aligned(max(-(-size // BLOCK) * BLOCK, BLOCK))
            n = os.preadv(fd, [buffer], 0)
            return bytes(buffer[:n])  # the bounce buffer is reused by this thread's next call
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _read_file_into(self, path: Path, payload: memoryview) -> bytes | None:
        """The header; the payload goes straight into `payload` (buffered I/O) or through an
        aligned buffer (O_DIRECT). A file shorter than its header says is `Corrupt`."""
        if self.direct:
            return self._read_direct_into(path, payload)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot open {path}: {e.strerror}") from e
        try:
            header = os.pread(fd, BLOCK, 0)
            lengths = peek_lengths(header)
            if lengths is not None and lengths[1] == len(payload):
                if os.preadv(fd, [payload], lengths[0]) != len(payload):
                    raise Corrupt("truncated", f"{path} is shorter than its header says")
            return header
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _read_direct_into(self, path: Path, payload: memoryview) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot open {path}: {e.strerror}") from e
        try:
            header = self._aligned(BLOCK)
            if _aligned(payload):  # a primary slot: DMA straight into it
                n = os.preadv(fd, [header, payload], 0)
                lengths = peek_lengths(header)
                if lengths is not None and (lengths[0] != BLOCK or lengths[1] != len(payload)):
                    return bytes(header)  # not laid out as we read it: refused upstairs
                if n < BLOCK + len(payload):
                    raise Corrupt("truncated", f"{path} is shorter than its header says")
                return bytes(header)
            size = os.fstat(fd).st_size
            buffer = self._aligned(max(-(-size // BLOCK) * BLOCK, BLOCK))
            n = os.preadv(fd, [buffer], 0)
            lengths = peek_lengths(buffer)
            if lengths is not None and lengths[1] == len(payload):
                offset, stored = lengths
                if offset + stored > n:
                    raise Corrupt("truncated", f"{path} holds {n} bytes")
                payload[:] = buffer[offset : offset + stored]
            return bytes(buffer[:BLOCK])
        except OSError as e:
            raise TierUnavailable(f"tier {self.name!r}: cannot read {path}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _check_free(self, size: int) -> None:
        stat = os.statvfs(self.base)
        free = stat.f_bavail * stat.f_frsize
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
        mapping: mmap.mmap | None = getattr(self._buffers, "mapping", None)
        if mapping is None or len(mapping) < size:
            mapping = mmap.mmap(-1, max(size, 1 << 20))
            self._buffers.mapping = mapping
        return memoryview(mapping)[:size]

    def raw_path(self, key: BlockKey) -> Path:
        """Where the object of `key` lives (for white-box tests and operators)."""
        return self._path(key)


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
