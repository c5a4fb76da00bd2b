"""The file tier's segment layout (`layout: segments`): blocks appended to large files.

A file per block costs the file system an inode, a directory entry and a rename per put and an
open per get: at 256 KiB that is a fifth to a third of the disk's time on the machines we measure
on (BENCHMARKS.md). Here a put is one `pwritev` at an offset reserved in the current segment
file (`<path>/<namespace hex>/<sequence>.kvs`, up to `segment_size`), and a get one `preadv`
on a file kept open; the object format is the same, each object starting on a 4 KiB boundary.

- Visibility: a block enters the index when its write has completed, so a get never sees a
  half-written block; a later put of the same key is appended elsewhere (never written in
  place), so a reader of the older copy is never torn.
- Restart: the index is rebuilt by reading each object's header in segment order (the header
  carries its own checksum); where no header parses, the scan steps 4 KiB and looks again, so a
  hole left by a crash costs time, never later blocks. The two newest segments, those a crash
  can have left half-written, also have every payload verified. Of two copies of a key, the later
  one wins, as in the index before the restart.
- Deletes write a tombstone over the object's header, so a restart does not bring it back; a
  segment with no live object left is removed.
- Capacity counts every byte of the segment files (dead objects too) and is enforced by removing
  the least recently used segment whole (a get or a put touches its segment). A segment is at
  most a sixteenth of the capacity, so an eviction frees a bounded share of it. Dead space is
  reclaimed when its segment goes; segments are not compacted.
- I/O: with O_DIRECT, reads and writes on open, preallocated segment files are made from the
  event loop by kernel AIO (`tiers.aio`), a batch's runs in one submission; what the kernel
  would block on, and everything where it has no AIO, goes through the tier's thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from tiering.errors import ConfigError, TierError, TierFull, TierTimeout, TierUnavailable
from tiering.format import (
    HEADER_MIN,
    Checksum,
    Corrupt,
    Header,
    decode_header,
    peek_key,
    peek_lengths,
)
from tiering.keys import BlockKey
from tiering.tier import Buffer, KeyLike, ObjectInfo, as_key
from tiering.units import parse_size
from tiers.aio import PREADV, PWRITEV, REDO, KernelAio
from tiers.file import BLOCK, FileTier, _aligned, _unlink

__all__ = ["SegmentFileTier"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_SUFFIX = ".kvs"
_MAX_RUN = 64  # objects per system call in a batch (IOV_MAX is 1024 vectors)
_RUN_BYTES = 1 << 20
"""Bytes per system call in a batch: larger runs leave the disk fewer requests in parallel
(a batch of 8 blocks of 256 KiB read 0.64-0.72 GiB/s in runs of 4, 0.57 in one run of 8)."""
_AIO_DEPTH = 256  # requests in flight in the kernel AIO context (the manager's max_inflight)
_TOMBSTONE = b"KVTIERDEAD\x00\x01"
_TOMB = struct.Struct(f"<{len(_TOMBSTONE)}sQ")  # the marker, then the dead record's length


def _record(length: int) -> int:
    """Bytes a stored object of `length` takes in a segment (whole 4 KiB blocks)."""
    return max(-(-length // BLOCK) * BLOCK, BLOCK)


@dataclass(eq=False, slots=True)
class _Segment:
    seq: int
    path: Path
    size: int = 0
    """Bytes reserved in the file: objects, dead objects, holes."""
    keys: set[BlockKey] = field(default_factory=set)
    """Keys whose current copy lives here."""
    users: int = 0
    """Calls in flight on the file; it is closed when it is gone and this is 0."""
    gone: bool = False
    counted: int = 0
    """Bytes it adds to the tier's `_bytes`: `size`, or `segment_size` from its creation when
    its file is preallocated (what it takes on disk)."""
    preallocated: bool = False
    """Its file was given `segment_size` bytes when created (trimmed to `size` on close)."""


@dataclass(frozen=True, slots=True)
class _Where:
    segment: _Segment
    offset: int
    length: int  # of the stored object


class SegmentFileTier(FileTier):
    """The file tier with blocks appended to segment files. Created by
    `FileTier(layout="segments", ...)`; the index and the segments' bookkeeping are only touched
    on the loop thread, file descriptors are opened by the pool's threads."""

    _objects = "*" + _SUFFIX
    _removes_damaged = False  # a damaged record is dead space until its segment goes

    def __init__(self, *, segment_size: int | str = "64MiB", **options: Any) -> None:
        size = parse_size(segment_size, "segment_size")
        if size < BLOCK:
            raise ConfigError(f"segment_size: at least 4KiB, got {segment_size!r}")
        self.segment_size = size
        self._segments: OrderedDict[int, _Segment] = OrderedDict()  # least recently used first
        self._where: dict[BlockKey, _Where] = {}
        self._landing: dict[BlockKey, _Where] = {}  # the latest put of a key, in flight
        self._voided: set[_Where] = set()  # puts in flight whose key was deleted meanwhile
        self._active: _Segment | None = None
        self._next_seq = 0
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._writer_lock: int | None = None
        self._preallocating = True
        self._aio: KernelAio | None = None
        self._aio_off = ""  # why kernel AIO is not used, once known
        self._pages: list[memoryview] = []  # free 4 KiB aligned headers for kernel AIO
        super().__init__(**options)
        if self.capacity is not None:
            self.segment_size = max(BLOCK, min(size, self.capacity // 16 // BLOCK * BLOCK))

    # -- start-up -------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        if not self.read_only:
            self._lock_directory()
        if not self.root.is_dir():
            return
        found: list[tuple[int, Path]] = []
        for path in self.root.iterdir():
            name = path.name
            if name.endswith(_SUFFIX) and name[: -len(_SUFFIX)].isdigit():
                if not path.is_file():  # a FIFO in its place would block the scan for ever
                    self._damaged_at_start(str(path.relative_to(self.base)), "magic", "not a file")
                    continue
                found.append((int(path.name[: -len(_SUFFIX)]), path))
        found.sort()
        newest = {seq for seq, _ in found[-2:]}
        for seq, path in found:
            segment = _Segment(seq, path)
            self._segments[seq] = segment
            self._next_seq = seq + 1
            try:
                self._scan(segment, verify=seq in newest)
            except OSError as e:
                log.warning("tier %r: cannot read segment %s at start: %s", self.name, path, e)
            if not segment.keys and not self.read_only:
                self._drop(segment)
        if self._where:
            log.info(
                "tier %r: %d blocks (%d bytes in %d segments) found in %s",
                self.name,
                len(self._where),
                self._bytes,
                len(self._segments),
                self.root,
            )

    def _lock_directory(self) -> None:
        """One writer per directory: two processes appending to the same segments would write
        over each other's objects. Readers (`read_only`) take no lock."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"tier {self.name!r}: cannot open {self.root}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"tier {self.name!r}: {self.root} is in use by another process (the segment "
                "layout allows one writer per directory; give each engine its own path, open "
                "this one read-only, or use layout: files)"
            ) from None
        self._writer_lock = fd

    def _scan(self, segment: _Segment, *, verify: bool) -> None:
        """Index the objects of one segment file, in file order. With `verify`, payloads are
        checked too, a chunk at a time and at most the file's size in all (headers that claim
        the whole file, one after another, cost one pass, not one each); what is left
        unchecked is checked by the reads, as every read is."""
        with open(segment.path, "rb", buffering=0) as f:
            fd = f.fileno()
            end = os.fstat(fd).st_size
            budget = end if verify else 0
            segment.size = segment.counted = -(-end // BLOCK) * BLOCK
            self._bytes += segment.size
            offset = 0
            while offset + HEADER_MIN <= end:
                raw = os.pread(fd, BLOCK, offset)
                if not any(raw):  # a preallocated tail, or a hole: skip it a chunk at a time
                    offset = _past_zeros(fd, offset, end)
                    continue
                if raw.startswith(_TOMBSTONE):
                    offset += _record(_TOMB.unpack_from(raw)[1])
                    continue
                key = peek_key(raw)
                try:
                    if key is None:
                        raise Corrupt("magic", "no object here")
                    header = decode_header(raw, key, self.namespace)
                    length = header.object_length
                    if offset + length > end:
                        raise Corrupt("truncated", f"object of {length} bytes at {offset}")
                    if header.stored_length <= budget:
                        budget -= header.stored_length
                        _verify_in_place(fd, header, offset + header.payload_offset)
                except Corrupt as e:
                    if key is not None:  # a header that named a key: worth a word
                        where = f"{segment.path.relative_to(self.base)} at {offset}"
                        self._damaged_at_start(where, e.reason, str(e))
                    offset += BLOCK
                    continue
                self._place(key, _Where(segment, offset, length))
                offset += _record(length)

    # -- the index, on the loop thread ----------------------------------------------------------

    def _place(self, key: BlockKey, where: _Where) -> None:
        """`where` holds the current copy of `key`."""
        old = self._where.get(key)
        if old is not None:
            old.segment.keys.discard(key)
            self._index.pop(key, None)
        self._where[key] = where
        self._index[key] = where.length
        where.segment.keys.add(key)

    def _reserve(self, length: int) -> _Where:
        segment = self._active
        if segment is None or (segment.size and segment.size + length > self.segment_size):
            segment = _Segment(self._next_seq, self.root / f"{self._next_seq:08d}{_SUFFIX}")
            self._next_seq += 1
            self._segments[segment.seq] = segment
            self._active = segment
            if self._preallocating:  # its file takes segment_size on disk from the start
                segment.counted = self.segment_size
                self._bytes += self.segment_size
        where = _Where(segment, segment.size, length)
        segment.size += _record(length)
        if segment.size > segment.counted:
            self._bytes += segment.size - segment.counted
            segment.counted = segment.size
        self._segments.move_to_end(segment.seq)
        return where

    def _touch_segment(self, segment: _Segment) -> None:
        if not segment.gone:
            self._segments.move_to_end(segment.seq)

    def _release(self, segment: _Segment) -> None:
        segment.users -= 1
        if segment.gone and segment.users == 0:
            # removed once nobody uses it: a pool thread opening it later would create it again
            fd = self._fds.pop(segment.seq, None)
            try:
                self._pool.submit(_close_and_unlink, fd, segment.path)
            except RuntimeError:  # no loop runs (the start-up scan), or the pool is shut down
                _close_and_unlink(fd, segment.path)

    def _drop(self, segment: _Segment, *, evicted: bool = False) -> None:
        """Forget `segment` and its objects; its file goes when no call uses it any more."""
        self._segments.pop(segment.seq, None)
        segment.gone = True
        self._bytes -= segment.counted
        for key in segment.keys:
            del self._where[key]
            self._index.pop(key, None)
        if evicted:
            self.counters["evictions"] += len(segment.keys)
        segment.keys.clear()
        if self._active is segment:
            self._active = None
        segment.users += 1
        self._release(segment)

    async def _evict_for(self, size: int) -> None:
        assert self.capacity is not None
        while self._segments and self._bytes + self._growth(size) > self.capacity:
            victim = next(iter(self._segments.values()))
            self._drop(victim, evicted=True)

    def _growth(self, size: int) -> int:
        """How much reserving `size` bytes of records grows `_bytes`: what the active segment
        has not counted yet, or a new segment (all of `segment_size` when preallocated)."""
        active = self._active
        if active is not None and active.size + size <= self.segment_size:
            return max(0, active.size + size - active.counted)
        return max(size, self.segment_size) if self._preallocating else size

    # -- primitives -----------------------------------------------------------------------------

    def _placed(self, key: BlockKey, limit: int) -> _Where | None:
        """Where the copy of `key` is, if any; `Corrupt("length")` if it is over `limit`."""
        where = self._where.get(key)
        if where is not None and where.length > limit:
            raise Corrupt("length", f"object of {where.length} bytes, at most {limit} expected")
        return where

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        where = self._placed(key, limit)
        if where is None:
            return None
        blob = await self._on(where.segment, self._read_object, where)
        if blob is not None:
            self._touch_segment(where.segment)
        return blob

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        where = self._placed(key, limit)
        if where is None:
            return None
        if self._laid_out(where, payload):
            done = await self._by_aio(PREADV, [[(where, payload)]])
            if done[0] is not None:
                answer: tuple[Buffer, bool] | BaseException | None = done[0][0]
                if isinstance(answer, BaseException):
                    raise answer
                if answer is not None:
                    self._touch_segment(where.segment)
                return answer
        got = await self._on(where.segment, self._read_object_into, where, payload)
        if got is not None:
            self._touch_segment(where.segment)
        return got

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        where = self._where.get(key)
        if where is None:
            return None
        head = await self._on(where.segment, self._read_object_head, where, n)
        return None if head is None else (head, where.length)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        size = sum(len(p) for p in parts)
        await self._make_room(size, _record(size))
        where = self._reserve(size)
        self._landing[key] = where
        try:
            done: list[list[Any] | None] = [None]
            if self._whole_blocks(parts):
                done = await self._by_aio(PWRITEV, [[(where, parts)]])
                if done[0] is not None and done[0][0] is not None:
                    raise done[0][0]
            if done[0] is None:
                await self._on(where.segment, self._write_object, where, parts)
        except BaseException:
            if self._landing.get(key) is where:
                del self._landing[key]
            self._voided.discard(where)
            raise
        await self._landed(key, where)

    async def _landed(self, key: BlockKey, where: _Where) -> None:
        """A put's object is on disk: it becomes the key's copy, unless the key was deleted
        or put again since (the later put wins, as a restart's scan would decide)."""
        if where in self._voided:  # deleted while in flight: a restart must not find it
            self._voided.discard(where)
            if not where.segment.gone:
                try:
                    await self._on(where.segment, self._bury, where)
                except TierError as e:  # the put did land; only the delete is incomplete
                    self.counters["tombstone_errors"] += 1
                    log.warning(
                        "tier %r: a deleted block may return after a restart: %s", self.name, e
                    )
            return
        if self._landing.get(key) is not where:
            return
        del self._landing[key]
        if where.segment.gone:  # evicted while being written
            return
        old = self._where.get(key)
        self._place(key, where)
        if old is not None and not old.segment.keys and old.segment is not self._active:
            self._drop(old.segment)

    async def _delete(self, key: BlockKey) -> bool:
        landing = self._landing.pop(key, None)
        if landing is not None:
            self._voided.add(landing)
        where = self._where.pop(key, None)
        if where is None:
            return landing is not None
        self._index.pop(key, None)
        segment = where.segment
        segment.keys.discard(key)
        if not segment.keys and segment is not self._active:
            self._drop(segment)
        else:
            await self._on(segment, self._bury, where)
        return True

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        for key, where in list(self._where.items()):
            try:
                st = await self._run(os.stat, where.segment.path)
            except FileNotFoundError:
                continue
            yield ObjectInfo(key, where.length, st.st_mtime)

    async def _close(self) -> None:
        if self._aio is not None:
            self._aio.close()  # waits for the requests in flight
        await super()._close()
        active = self._active
        if active is not None and active.preallocated and active.seq in self._fds:
            try:  # the preallocated tail goes back to the disk; a restart scans less
                os.ftruncate(self._fds[active.seq], active.size)
            except OSError as e:
                log.warning("tier %r: cannot trim %s: %s", self.name, active.path, e)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._writer_lock is not None:
            os.close(self._writer_lock)  # and with it the lock
            self._writer_lock = None

    async def _on(self, segment: _Segment, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in the pool, with `segment`'s file kept open meanwhile."""
        segment.users += 1
        try:
            return await self._run(function, *args)
        finally:
            self._release(segment)

    # -- batches: one pool call per group of blocks -----------------------------------------------

    async def get_many(
        self, items: Sequence[tuple[KeyLike, memoryview | bytearray]]
    ) -> list[bool | BaseException]:
        if len(items) < 2 or self.codec != "raw":
            return await super(FileTier, self).get_many(items)
        blocks = [as_key(k) for k, _ in items]
        views = [memoryview(buffer).cast("B") for _, buffer in items]
        places = [self._where.get(block) for block in blocks]
        oversized: dict[int, Corrupt] = {}
        for i, (where, view) in enumerate(zip(places, views, strict=True)):
            if where is not None and where.length > self.object_limit(len(view)):
                oversized[i] = Corrupt("length", f"object of {where.length} bytes")
                places[i] = None
        jobs = [(where, view) for where, view in zip(places, views, strict=True)]
        fits = [where is not None and self._laid_out(where, view) for where, view in jobs]
        held = [where.segment for where in places if where is not None]
        for segment in held:
            segment.users += 1
        try:
            answers = await self._in_runs(PREADV, jobs, fits)
        finally:
            for segment in held:
                self._release(segment)
        for i, error in oversized.items():
            answers[i] = error

        def touch(i: int) -> None:
            where = places[i]
            if where is not None:
                self._touch_segment(where.segment)

        return await self._finish_reads(blocks, views, answers, touch)

    async def put_many(
        self, items: Sequence[tuple[KeyLike, Buffer | bytearray]]
    ) -> list[None | BaseException]:
        if len(items) < 2 or self.read_only:
            return await super(FileTier, self).put_many(items)
        encoded, sizes, results, todo = self._encode_batch(items)
        if self.capacity is not None:
            growth = sum(_record(sizes[i]) for i in todo)
            await self._evict_for(min(growth, self.capacity))
        places = []
        for i in todo:
            where = self._reserve(sizes[i])
            self._landing[encoded[i][0]] = where
            where.segment.users += 1
            places.append(where)
        jobs = [(where, encoded[i][1]) for i, where in zip(todo, places, strict=True)]
        fits = [self._whole_blocks(parts) for _, parts in jobs]
        try:
            outcomes = await self._in_runs(PWRITEV, jobs, fits)
        finally:
            for where in places:
                self._release(where.segment)
        for i, where, outcome in zip(todo, places, outcomes, strict=True):
            block = encoded[i][0]
            if outcome is None:
                await self._landed(block, where)
                self.counters["puts"] += 1
                self.counters["bytes_written"] += len(items[i][1])
            else:
                if self._landing.get(block) is where:
                    del self._landing[block]
                self._voided.discard(where)
                self.counters["errors"] += 1
                results[i] = outcome
        return results

    async def _in_runs(
        self, op: int, jobs: Sequence[tuple[_Where | None, Any]], fits: list[bool]
    ) -> list[Any]:
        """Reads (`PREADV`) or writes (`PWRITEV`) of `jobs` gathered in runs: objects that lie
        back to back in one segment, in file order, move in one request (a batch of blocks put
        together is read back together), by kernel AIO where it can, else in the pool; a job
        that does not `fit` a run (not laid out for one) stands alone. A job with no place
        answers None."""
        order = sorted(
            (i for i, (where, _) in enumerate(jobs) if where is not None),
            key=lambda i: (jobs[i][0].segment.seq, jobs[i][0].offset),  # type: ignore[union-attr]
        )
        runs: list[list[int]] = []
        run_bytes = 0
        for i in order:
            where = jobs[i][0]
            assert where is not None
            if runs and fits[i] and fits[runs[-1][-1]] and len(runs[-1]) < _MAX_RUN:
                last = jobs[runs[-1][-1]][0]
                assert last is not None
                if (
                    last.segment is where.segment
                    and last.offset + _record(last.length) == where.offset
                    and run_bytes + where.length <= _RUN_BYTES
                ):
                    runs[-1].append(i)
                    run_bytes += where.length
                    continue
            runs.append([i])
            run_bytes = where.length
        answers: list[Any] = [None] * len(jobs)
        moved = cast(list[list[tuple[_Where, Any]]], [[jobs[i] for i in run] for run in runs])
        done: list[Any] = [None] * len(runs)
        whole = [k for k, run in enumerate(runs) if all(fits[i] for i in run)]
        if whole:
            got_by_aio = await self._by_aio(op, [moved[k] for k in whole], self.timeout)
            for k, got in zip(whole, got_by_aio, strict=True):
                done[k] = got
        rest = [k for k, got in enumerate(done) if got is None]  # in the pool's threads
        if rest:
            work = self._write_runs if op == PWRITEV else self._read_runs
            got_in_pool = await self._in_groups(work, [moved[k] for k in rest])
            for k, got in zip(rest, got_in_pool, strict=True):
                done[k] = got
        for run, got in zip(runs, done, strict=True):
            for k, i in enumerate(run):
                answers[i] = got if isinstance(got, BaseException) else got[k]
        return answers

    def _read_runs(self, runs: list[list[tuple[_Where, memoryview]]]) -> list[Any]:
        return _by_run(runs, self._read_segment_group, self._read_run)

    def _write_runs(self, runs: list[list[tuple[_Where, Sequence[Buffer]]]]) -> list[Any]:
        return _by_run(runs, self._write_segment_group, self._write_run)

    def _read_run(self, run: list[tuple[_Where, memoryview]]) -> list[Any]:
        """Objects back to back, each a 4 KiB header and a payload read into its view."""
        first = run[0][0]
        pages = self._aligned(len(run) * BLOCK)
        headers = [pages[k * BLOCK : (k + 1) * BLOCK] for k in range(len(run))]
        vectors: list[memoryview] = []
        for header, (_, view) in zip(headers, run, strict=True):
            vectors += [header, view]
        try:
            n = os.preadv(self._fd(first.segment), vectors, first.offset)
        except OSError as e:
            raise self._unavailable("read", first, e) from e
        return _read_answers(run, headers, n)

    def _write_run(self, run: list[tuple[_Where, Sequence[Buffer]]]) -> list[None]:
        first, last = run[0][0], run[-1][0]
        if not self._allocated(first, last.offset + last.length):
            self._check_free(sum(where.length for where, _ in run))
        headers = self._aligned(len(run) * BLOCK)
        vectors: list[Buffer] = []
        for k, (_, (header, payload)) in enumerate(run):
            aligned = headers[k * BLOCK : (k + 1) * BLOCK]
            aligned[:] = header
            vectors += [aligned, payload]
        self._pwrite(first, vectors)
        return [None] * len(run)

    def _read_segment_group(self, jobs: Sequence[tuple[_Where | None, memoryview]]) -> list[Any]:
        return _one_by_one(
            jobs, lambda where, view: None if where is None else self._read_object_into(where, view)
        )

    def _write_segment_group(self, jobs: list[tuple[_Where, Sequence[Buffer]]]) -> list[Any]:
        return _one_by_one(jobs, self._write_object)

    # -- kernel AIO from the loop (tiers/aio.py) -------------------------------------------------

    def _laid_out(self, where: _Where, view: memoryview) -> bool:
        """Whether a read of `where` can place its payload straight into `view`."""
        return (
            where.length == BLOCK + len(view)
            and len(view) % BLOCK == 0
            and (not self.direct or _aligned(view))
        )

    def _whole_blocks(self, parts: Sequence[Buffer]) -> bool:
        """Whether an object goes to disk from where its parts lie: a 4 KiB header, then a
        payload of whole blocks (page-aligned with O_DIRECT)."""
        return (
            len(parts) == 2
            and len(parts[0]) == BLOCK
            and len(parts[1]) % BLOCK == 0
            and (not self.direct or _aligned(memoryview(parts[1])))
        )

    def _allocated(self, where: _Where, end: int) -> bool:
        """Whether `where`'s segment file had its bytes up to `end` allocated when created (a
        write there takes no more space, and extends nothing)."""
        return where.segment.preallocated and end <= self.segment_size

    def _kernel_aio(self) -> KernelAio | None:
        """The kernel AIO context, bound to the running loop; None where there is none, or it
        is busy with another loop's calls."""
        if self._aio_off:
            return None
        if self._aio is None:
            if not self.direct or not self.aio:
                self._aio_off = "buffered I/O" if self.aio else "aio: false"
                return None
            try:
                self._aio = KernelAio(_AIO_DEPTH)
            except OSError as e:
                self._aio_off = str(e)
                log.info("tier %r: no kernel AIO (%s): I/O goes through threads", self.name, e)
                return None
            pages = memoryview(mmap.mmap(-1, _AIO_DEPTH * BLOCK))
            self._pages = [pages[i * BLOCK : (i + 1) * BLOCK] for i in range(_AIO_DEPTH)]
        return self._aio if self._aio.bind(asyncio.get_running_loop()) else None

    async def _by_aio(
        self, op: int, runs: list[list[tuple[_Where, Any]]], deadline: float | None = None
    ) -> list[list[Any] | None]:
        """Runs of objects (back to back in one segment, each laid out as whole blocks: a view
        to read into, or a header and payload to write) read or written by kernel AIO, one
        request per run, all submitted at once. A run's answers are those the pool's
        `_read_runs` / `_write_runs` give; None for a run left to the pool (no kernel AIO, its
        file not open yet, a read-only buffer, no free header page, fsync, a request the
        kernel would have blocked on). `deadline`: seconds per run, for batches."""
        out: list[list[Any] | None] = [None] * len(runs)
        aio = None if op == PWRITEV and self.fsync else self._kernel_aio()
        if aio is None:
            return out
        requests = []
        chosen: list[tuple[int, list[memoryview], int]] = []  # run, its headers, its bytes
        for k, run in enumerate(runs):
            first = run[0][0]
            fd = self._fds.get(first.segment.seq)  # opening (and preallocating) is the pool's
            last = run[-1][0]
            if op == PWRITEV and not self._allocated(first, last.offset + last.length):
                continue  # writes that extend a file would answer EAGAIN (RWF_NOWAIT)
            views = [memoryview(job[1] if op == PWRITEV else job) for _, job in run]
            if (
                fd is None
                or len(self._pages) < len(run)
                or any(v.readonly or not v.c_contiguous for v in views)
            ):
                continue
            payloads = [v.cast("B") for v in views]
            pages = [self._pages.pop() for _ in run]
            vectors = []
            for page, payload, (_, job) in zip(pages, payloads, run, strict=True):
                if op == PWRITEV:
                    page[:] = job[0]
                vectors += [page, payload]
            requests.append((op, fd, vectors, first.offset))
            chosen.append((k, pages, sum(len(v) for v in vectors)))
        if not requests:
            return out
        segments = [runs[k][0][0].segment for k, _, _ in chosen]
        for segment in segments:
            segment.users += 1
        try:
            try:
                if deadline is None:  # a single call: the caller's deadline holds
                    results = await aio.wait(aio.submit(requests))
                else:
                    async with asyncio.timeout(deadline * len(runs)):
                        results = await aio.wait(aio.submit(requests))
            except TimeoutError:
                error = TierTimeout(f"tier {self.name!r}: no answer within the deadline")
                for k, _, _ in chosen:
                    out[k] = [error] * len(runs[k])
                return out
            self.counters["aio_requests"] += len(requests)
            for (k, pages, total), n in zip(chosen, results, strict=True):
                out[k] = self._aio_answers(op, runs[k], pages, n, total)
                if out[k] is None:
                    self.counters["aio_redone"] += 1
            return out
        finally:
            for segment in segments:
                self._release(segment)
            for _, pages, _ in chosen:
                self._pages += pages

    def _aio_answers(
        self, op: int, run: list[tuple[_Where, Any]], pages: list[memoryview], n: int, total: int
    ) -> list[Any] | None:
        """A run's answers from its request's result `n` (bytes, or a negative errno; `total`
        bytes were asked for)."""
        first = run[0][0]
        if n < 0 and -n in REDO:
            if -n != errno.EAGAIN and not self._aio_off:  # the file system cannot: stop asking
                self._aio_off = os.strerror(-n)
                log.info(
                    "tier %r: kernel AIO refused by %s (%s): I/O goes through threads",
                    self.name,
                    self.root,
                    self._aio_off,
                )
            return None
        if n < 0:
            e = OSError(-n, os.strerror(-n))
            if op == PWRITEV and -n in (errno.ENOSPC, errno.EDQUOT):
                full = TierFull(f"tier {self.name!r}: disk full writing {first.segment.path}")
                return [full] * len(run)
            return [self._unavailable("read" if op == PREADV else "write", first, e)] * len(run)
        if op == PREADV:
            return _read_answers(run, pages, n)
        if n != total:
            short = OSError(errno.EIO, f"short write ({n} of {total})")
            return [self._unavailable("write", first, short)] * len(run)
        return [None] * len(run)

    # -- file I/O, in the pool -------------------------------------------------------------------

    def _fd(self, segment: _Segment) -> int:
        fd = self._fds.get(segment.seq)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(segment.seq)
                if fd is None:
                    if self.read_only:
                        flags = os.O_RDONLY
                    else:
                        flags = os.O_RDWR | os.O_CREAT
                        if not self.root.is_dir():
                            self.root.mkdir(parents=True, exist_ok=True)
                    fd = os.open(segment.path, flags | self._flags(), 0o644)
                    if segment is self._active and not self.read_only:
                        self._preallocate(fd, segment)
                    self._fds[segment.seq] = fd
        return fd

    def _preallocate(self, fd: int, segment: _Segment) -> None:
        """Give a new segment file its blocks up front (`posix_fallocate`): appending O_DIRECT
        writes extend the file and serialize on its metadata, writes inside it do not (eight
        threads of 256 KiB writes: 0.87-0.95 GiB/s appending, 1.25-1.45 preallocated, here).
        Skipped where the file system cannot, or when it would leave less than `min_free`; the
        unused tail is zeros, trimmed on close and skipped by a restart's scan. Best effort: it
        never raises (the caller has just opened `fd` and would leak it); a segment left
        unallocated is still counted at `segment_size`, which errs towards evicting early."""
        if not self._preallocating:
            return
        try:
            if os.fstat(fd).st_size:
                return
            self._check_free(self.segment_size)
            os.posix_fallocate(fd, 0, self.segment_size)
        except TierFull:
            return
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._preallocating = False
                log.info("tier %r: %s cannot preallocate files (%s)", self.name, self.root, e)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an ENOSPC may leave part of it allocated
            return
        segment.preallocated = True

    def _read_object_into(self, where: _Where, payload: memoryview) -> tuple[Buffer, bool] | None:
        """(header, True) with the payload read straight into `payload` when the object is
        laid out as a 4 KiB header and a block of that size; otherwise (the whole object,
        False), as `ReadsInto` says."""
        if where.length == BLOCK + len(payload) and (not self.direct or _aligned(payload)):
            header = self._aligned(BLOCK)
            try:
                n = os.preadv(self._fd(where.segment), [header, payload], where.offset)
            except OSError as e:
                raise self._unavailable("read", where, e) from e
            if bytes(header[: len(_TOMBSTONE)]) == _TOMBSTONE:
                return None  # deleted while this read was on its way
            if n < where.length:
                raise Corrupt("truncated", f"{where.segment.path} ends inside an object")
            if peek_lengths(header) == (BLOCK, len(payload)):
                return bytes(header), True
            # not laid out as we read it (what was read into `payload` is garbage): as it is
        blob = self._read_object(where)
        return None if blob is None else (blob, False)

    def _read_object_head(self, where: _Where, n: int) -> bytes | None:
        want = min(n, where.length)
        buffer = self._aligned(_record(want))  # O_DIRECT reads whole aligned blocks
        try:
            got = os.preadv(self._fd(where.segment), [buffer], where.offset)
        except OSError as e:
            raise self._unavailable("read", where, e) from e
        head = bytes(buffer[: min(got, want)])
        return None if head.startswith(_TOMBSTONE) else head

    def _read_object(self, where: _Where) -> bytes | None:
        buffer = self._aligned(_record(where.length))
        try:
            n = os.preadv(self._fd(where.segment), [buffer], where.offset)
        except OSError as e:
            raise self._unavailable("read", where, e) from e
        if bytes(buffer[: len(_TOMBSTONE)]) == _TOMBSTONE:
            return None
        if n < where.length:
            raise Corrupt("truncated", f"{where.segment.path} ends inside an object")
        return bytes(buffer[: where.length])

    def _write_object(self, where: _Where, parts: Sequence[Buffer]) -> None:
        if not self._allocated(where, where.offset + where.length):
            self._check_free(where.length)
        self._pwrite(where, self._gather(parts, where.length))

    def _pwrite(self, where: _Where, vectors: Sequence[Buffer]) -> None:
        """`vectors` at `where`'s offset, all of them (and flushed with `fsync`)."""
        total = sum(len(v) for v in vectors)
        try:
            fd = self._fd(where.segment)
            written = os.pwritev(fd, vectors, where.offset)
            if written != total:
                raise OSError(errno.EIO, f"short write ({written} of {total})")
            if self.fsync:
                os.fdatasync(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"tier {self.name!r}: disk full writing {where.segment.path}") from e
            raise self._unavailable("write", where, e) from e

    def _bury(self, where: _Where) -> None:
        """Write a tombstone over a dead object's header."""
        tomb = self._aligned(BLOCK)
        tomb[:] = bytes(BLOCK)
        _TOMB.pack_into(tomb, 0, _TOMBSTONE, where.length)
        try:
            os.pwritev(self._fd(where.segment), [tomb], where.offset)
            if self.fsync:
                os.fdatasync(self._fd(where.segment))
        except OSError as e:
            raise self._unavailable("delete in", where, e) from e

    def _unavailable(self, what: str, where: _Where, e: OSError) -> TierUnavailable:
        return TierUnavailable(
            f"tier {self.name!r}: cannot {what} {where.segment.path} at {where.offset}: "
            f"{e.strerror or e}"
        )

    # -- for white-box tests and operators -------------------------------------------------------

    def raw_path(self, key: BlockKey) -> Path:
        """The segment file holding `key` (see `raw_location`)."""
        where = self._where.get(key)
        if where is None:
            raise KeyError(key.hex())
        return where.segment.path

    def raw_location(self, key: BlockKey) -> tuple[Path, int, int] | None:
        """(segment file, offset, object length) of `key`'s copy, or None."""
        where = self._where.get(key)
        return None if where is None else (where.segment.path, where.offset, where.length)


def _by_run(
    runs: Sequence[list[Any]],
    alone: Callable[[list[Any]], list[Any]],
    together: Callable[[list[Any]], list[Any]],
) -> list[Any]:
    """Each run's answers: `together(run)` for objects back to back (one system call; a
    `TierError` fails each of them), `alone` for a run of one (it also takes objects that are
    not laid out for a run)."""
    out: list[Any] = []
    for run in runs:
        if len(run) == 1:
            out.append(alone(run))
            continue
        try:
            out.append(together(run))
        except TierError as e:
            out.append([e] * len(run))
    return out


def _one_by_one(jobs: Sequence[tuple[Any, Any]], do: Callable[[Any, Any], Any]) -> list[Any]:
    """`do(where, data)` for each job: its answer, or the `TierError` / `Corrupt` it raised."""
    out: list[Any] = []
    for where, data in jobs:
        try:
            out.append(do(where, data))
        except (TierError, Corrupt) as e:
            out.append(e)
    return out


def _read_answers(
    run: Sequence[tuple[_Where, memoryview]], headers: Sequence[memoryview], n: int
) -> list[Any]:
    """Each object's answer to a read of `run` (objects back to back, their 4 KiB headers read
    into `headers`, `n` bytes read in all): (its header, True) as `ReadsInto` says, checked
    upstairs; None for a tombstone; `Corrupt` where the file ended inside it."""
    first = run[0][0]
    answers: list[Any] = []
    for (where, _), page in zip(run, headers, strict=True):
        header = bytes(page)
        if header.startswith(_TOMBSTONE):
            answers.append(None)
        elif n < where.offset - first.offset + where.length:
            answers.append(Corrupt("truncated", f"{where.segment.path} ends inside an object"))
        else:
            answers.append((header, True))
    return answers


def _verify_in_place(fd: int, header: Header, at: int) -> None:
    """Check the checksum of the payload `header` describes, at `at` in `fd`, reading it a
    chunk at a time (a header may claim up to 1 GiB)."""
    digest = Checksum(header.checksum_kind)
    left = header.stored_length
    while left:
        chunk = os.pread(fd, min(left, _ZERO_CHUNK), at)
        if not chunk:
            raise Corrupt("truncated", "the segment ends inside a payload")
        digest.update(chunk)
        at += len(chunk)
        left -= len(chunk)
    if digest.value() != header.payload_checksum:
        raise Corrupt("checksum", "payload checksum mismatch")


def _past_zeros(fd: int, offset: int, end: int) -> int:
    """The first block-aligned offset at or after `offset` whose block is not all zeros (or
    `end`). Holes are skipped without reading them (`SEEK_DATA`): a sparse file of any size
    costs a system call, not a read of its zeros."""
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # no data after `offset` (ENXIO), or no SEEK_DATA here: read on
            data = end if _no_data_after(fd, offset) else offset
        if data > offset:
            offset = min(end, data // BLOCK * BLOCK)
            continue
        chunk = os.pread(fd, _ZERO_CHUNK, offset)
        if not chunk:
            return end
        stripped = chunk.lstrip(b"\0")
        if stripped:
            return offset + (len(chunk) - len(stripped)) // BLOCK * BLOCK
        offset += len(chunk)
    return end


_ZERO_CHUNK = 1 << 20


def _no_data_after(fd: int, offset: int) -> bool:
    """Whether `SEEK_DATA` from `offset` said there is no data after it (ENXIO), rather than
    that the file system cannot tell (EINVAL and the like)."""
    try:
        os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as e:
        return e.errno == errno.ENXIO
    return False


def _close_and_unlink(fd: int | None, path: Path) -> None:
    if fd is not None:
        os.close(fd)
    _unlink(path)
