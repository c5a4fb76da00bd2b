"""The file tier's segment layout (`layout: segments`): blocks appended to large files.

A file per block costs the file system an inode, a directory entry and a rename per put and an open
per get, a large share of the disk's time at the block sizes vLLM uses (BENCHMARKS.md, "Secondary
tiers against raw baselines"). Here a put is one `pwritev` at an offset reserved in the current
segment file (`<path>/<namespace hex>/<sequence>.kvs`, up to `segment_size`), and a get one `preadv`
on a file kept open; the object format is the same, each object starting on a 4 KiB boundary.

- Visibility: a block enters the index when its write has completed, so a get never sees a
  half-written block; a later put of the same key is appended elsewhere (never written in
  place), so a reader of the older copy is never torn.
- Restart: the index is rebuilt from the segment files (`tiers.file.recovery`).
- Deletes write a tombstone over the object's header, so a restart does not bring it back; a
  segment with no live object left is removed.
- Capacity counts every byte of the segment files (dead objects too) and is enforced by removing
  the least recently used segment whole (a get or a put touches its segment). A segment is at
  most a sixteenth of the capacity, so an eviction frees a bounded share of it. Dead space is
  reclaimed when its segment goes; segments are not compacted.

The pieces: `SegmentLedger` (`tiers.file.ledger`: the bookkeeping, no I/O), `SegmentFiles`
(`tiers.file.segment_io`: reads and writes in the thread pool), `SegmentAio`
(`tiers.file.segment_aio`: reads and writes by kernel AIO from the loop, with O_DIRECT, where
the kernel allows; everything else goes through the pool). What is here is the loop's side of
each primitive and batch: where each goes, and what it changes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

from tiering.errors import ConfigError, CorruptObject, TierError, TierFull
from tiering.keys import BlockKey
from tiering.tier import Buffer, ObjectInfo
from tiering.tier.batching import RawRead, RawWrite
from tiering.tier.counters import EVICTIONS
from tiering.tier.options import TierOptions, option
from tiers.file.aio import PREADV, PWRITEV
from tiers.file.base import FileOptions, FileTier, log
from tiers.file.direct import BLOCK
from tiers.file.ledger import SUFFIX, Place, Segment, SegmentLedger, record_size
from tiers.file.locks import HeldFile, holder_line, lock, open_regular, read_holder
from tiers.file.recovery import scan_segment
from tiers.file.segment_aio import SegmentAio
from tiers.file.segment_io import SegmentFiles, close_and_unlink

__all__ = ["SegmentFileTier", "SegmentOptions"]

T = TypeVar("T")

_MAX_RUN = 64  # objects per system call in a batch (IOV_MAX is 1024 vectors)
_RUN_BYTES = 1 << 20
"""Bytes per system call in a batch: larger runs leave the disk fewer requests in parallel
(BENCHMARKS.md, "Secondary tiers against raw baselines")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentOptions(FileOptions):
    """The options of the `segments` layout (any thread: a value)."""

    layout: str = option("segments", choices=("segments",), help="Blocks in segment files.")
    segment_size: int = option(
        64 << 20,
        kind="size",
        help="The largest segment file (at least 4KiB; at most a sixteenth of `capacity`).",
    )
    aio: bool = option(
        True,
        help="With O_DIRECT, I/O by Linux kernel AIO from the event loop where the kernel and "
        "file system allow, instead of through the thread pool.",
    )

    def __post_init__(self) -> None:
        if self.segment_size < BLOCK:
            raise ConfigError(f"segment_size: at least 4KiB, got {self.segment_size}")


class SegmentFileTier(FileTier, layout="segments"):
    """Runtime thread (the event loop): the file tier with blocks appended to segment files.
    The index and the segments' bookkeeping are only touched on the loop thread; file
    descriptors are opened by the pool's threads."""

    Options: ClassVar[type[TierOptions]] = SegmentOptions
    options: SegmentOptions
    _objects = "*" + SUFFIX

    def __init__(self, **options: Any) -> None:
        """`options`: those of `SegmentOptions`, as `FileTier` says."""
        super().__init__(**options)
        size = self.options.segment_size
        if self.capacity is not None:
            size = max(BLOCK, min(size, self.capacity // 16 // BLOCK * BLOCK))
        self._ledger = SegmentLedger(self.root, size, self._remove_unused)
        self._index: dict[BlockKey, Place] = self._ledger.where
        self._files = SegmentFiles(
            name=self.name,
            root=self.root,
            direct=self.direct,
            fsync=self.fsync,
            read_only=self.read_only,
            ledger=self._ledger,
            buffers=self._buffers,
            check_free=self._check_free,
            gather=self._gather,
        )
        self._aio = SegmentAio(
            name=self.name,
            root=self.root,
            enabled=self.options.aio,
            direct=self.direct,
            fsync=self.fsync,
            files=self._files,
            ledger=self._ledger,
            counters=self.counters,
        )
        self._writer_lock: HeldFile | None = None
        self._rebuild_index()

    @property
    def segment_size(self) -> int:
        return self._ledger.segment_size

    # -- start-up -------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        if not self.read_only:
            self._lock_directory()
        if not self.root.is_dir():
            return
        found: list[tuple[int, Path]] = []
        for path in self.root.iterdir():
            name = path.name
            if name.endswith(SUFFIX) and name[: -len(SUFFIX)].isdigit():
                if not path.is_file():  # a FIFO in its place would block the scan for ever
                    where = str(path.relative_to(self.base))
                    self._damaged_at_start(where, "magic", "not a file", removed=False)
                    continue
                found.append((int(path.name[: -len(SUFFIX)]), path))
        found.sort()
        newest = {seq for seq, _ in found[-2:]}
        for seq, path in found:
            segment = self._ledger.add_found(seq, path)
            damaged: list[tuple[int, str, str]] = []

            def note(offset: int, reason: str, detail: str, into: list[Any] = damaged) -> None:
                into.append((offset, reason, detail))

            try:
                scan_segment(
                    segment, self._ledger, self.namespace, verify=seq in newest, damaged=note
                )
            except OSError as e:
                log.warning("tier %r: cannot read segment %s at start: %s", self.name, path, e)
            # A damaged record is dead space, left until its segment goes: at once, with the
            # segment, when nothing in it is live.
            dropped = not segment.keys and not self.read_only
            if dropped:
                self._ledger.drop(segment)
            for offset, reason, detail in damaged:
                where = f"{path.relative_to(self.base)} at {offset}"
                self._damaged_at_start(where, reason, detail, removed=dropped)
        if self._index:
            log.info(
                "tier %r: %d blocks (%d bytes in %d segments) found in %s",
                self.name,
                len(self._index),
                self._ledger.bytes,
                len(self._ledger.segments),
                self.root,
            )

    def _lock_directory(self) -> None:
        """One writer per directory: two processes appending to the same segments would write
        over each other's objects. The lock's file records its holder (pid, host, start), so
        a second writer's error names it. Readers (`read_only`) take no lock."""
        path = self.root / ".writer.lock"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"tier {self.name!r}: cannot make {self.root}: {e.strerror}") from e
        fd = open_regular(path, create=True)
        if fd is None:
            raise ConfigError(f"tier {self.name!r}: cannot open {path} (not a regular file?)")
        held = HeldFile(fd, path)
        if not lock(fd) or not held.still_there:
            held.close()
            raise ConfigError(
                f"tier {self.name!r}: {self.root} is in use by another writer, "
                f"{read_holder(path)} (the segment layout allows one writer per directory: "
                "give each engine its own path, open this one read-only, or use layout: files)"
            )
        held.record(holder_line())
        self._writer_lock = held

    # -- bookkeeping ----------------------------------------------------------------------------

    def _bytes_used(self) -> int:
        return self._ledger.bytes

    def _remove_unused(self, segment: Segment) -> None:
        """A dropped segment no call uses any more: its file goes, in the pool."""
        fd = self._files.fds.pop(segment.seq, None)
        try:
            self._pool.submit(close_and_unlink, fd, segment.path)
        except RuntimeError:  # no loop runs (the start-up scan), or the pool is shut down
            close_and_unlink(fd, segment.path)

    async def _make_room(self, size: int, growth: int) -> None:
        """Evict for an object of `size` that grows the tier by `growth` (with a capacity)."""
        if self.capacity is None:
            return
        if size > self.capacity:
            raise TierFull(f"tier {self.name!r}: an object of {size} bytes exceeds the capacity")
        await self._evict_for(growth)

    async def _evict_for(self, size: int) -> None:
        """Evict until `size` more bytes fit in the capacity (there is one)."""
        assert self.capacity is not None
        self.counters[EVICTIONS] += self._ledger.evict_for(size, self.capacity)

    def _placed(self, key: BlockKey, limit: int) -> Place | None:
        """Where the copy of `key` is, if any; `CorruptObject("length")` if it is over `limit`."""
        place = self._index.get(key)
        if place is not None and place.length > limit:
            raise CorruptObject(
                "length", f"object of {place.length} bytes, at most {limit} expected"
            )
        return place

    async def _on(self, segment: Segment, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in the pool, with `segment`'s file kept open meanwhile."""
        with self._ledger.using(segment):
            return await self._run(function, *args)

    # -- primitives -----------------------------------------------------------------------------

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        place = self._placed(key, limit)
        if place is None:
            return None
        blob = await self._on(place.segment, self._files.read_object, place)
        if blob is not None:
            self._ledger.touch(place.segment)
        return blob

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        place = self._placed(key, limit)
        if place is None:
            return None
        if self._files.laid_out(place, payload):
            done = await self._aio.move(PREADV, [[(place, payload)]])
            if done[0] is not None:
                answer: tuple[Buffer, bool] | BaseException | None = done[0][0]
                if isinstance(answer, BaseException):
                    raise answer
                if answer is not None:
                    self._ledger.touch(place.segment)
                return answer
        got = await self._on(place.segment, self._files.read_object_into, place, payload)
        if got is not None:
            self._ledger.touch(place.segment)
        return got

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        place = self._index.get(key)
        if place is None:
            return None
        head = await self._on(place.segment, self._files.read_object_head, place, n)
        return None if head is None else (head, place.length)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        size = sum(len(p) for p in parts)
        await self._make_room(size, record_size(size))
        place = self._ledger.reserve(size)
        self._ledger.begin_put(key, place)
        try:
            done: list[list[Any] | None] = [None]
            if self._files.whole_blocks(parts):
                done = await self._aio.move(PWRITEV, [[(place, parts)]])
                if done[0] is not None and done[0][0] is not None:
                    raise done[0][0]
            if done[0] is None:
                await self._on(place.segment, self._files.write_object, place, parts)
        except BaseException:
            self._ledger.abandon_put(key, place)
            raise
        await self._landed(key, place)

    async def _landed(self, key: BlockKey, place: Place) -> None:
        """A put's object is on disk (`SegmentLedger.land`); one whose key was deleted while
        it was on its way gets a tombstone, so a restart does not find it."""
        if not self._ledger.land(key, place):
            return
        try:
            await self._on(place.segment, self._files.write_tombstone, place)
        except TierError as e:  # the put did land; only the delete is incomplete
            self.counters["tombstone_errors"] += 1
            log.warning("tier %r: a deleted block may return after a restart: %s", self.name, e)

    async def _delete(self, key: BlockKey) -> bool:
        found, dead = self._ledger.delete(key)
        if dead is not None:
            await self._on(dead.segment, self._files.write_tombstone, dead)
        return found

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        for key, place in list(self._index.items()):
            try:
                st = await self._run(os.stat, place.segment.path)
            except FileNotFoundError:
                continue
            yield ObjectInfo(key, place.length, st.st_mtime)

    async def _close(self) -> None:
        self._aio.close()  # waits for the requests in flight
        await super()._close()
        self._files.close()
        if self._writer_lock is not None:
            self._writer_lock.close()  # and with it the lock
            self._writer_lock = None

    # -- batches: runs of blocks back to back, one request each ---------------------------------

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead] | None:
        """Each object read into its view where it is laid out for it, runs of them in one
        request each (`_in_runs`); each answer as `_read_into`'s, verified by the base."""
        if len(keys) < 2 or self.codec != "raw":
            return None
        places = [self._index.get(key) for key in keys]
        oversized: dict[int, CorruptObject] = {}
        for i, (place, limit) in enumerate(zip(places, limits, strict=True)):
            if place is not None and place.length > limit:
                oversized[i] = CorruptObject("length", f"object of {place.length} bytes")
                places[i] = None
        jobs = list(zip(places, payloads, strict=True))
        fits = [place is not None and self._files.laid_out(place, view) for place, view in jobs]
        with self._ledger.using(*(place.segment for place in places if place is not None)):
            answers: list[RawRead] = await self._in_runs(PREADV, jobs, fits)
        for i, error in oversized.items():
            answers[i] = error
        for place, answer in zip(places, answers, strict=True):
            if place is not None and answer is not None and not isinstance(answer, BaseException):
                self._ledger.touch(place.segment)
        return answers

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        """Runs of records back to back in one request each (`_in_runs`)."""
        if len(objects) < 2:
            return None
        sizes, answers, todo = self._room_for(objects)
        if self.capacity is not None:
            growth = sum(record_size(sizes[i]) for i in todo)
            await self._evict_for(min(growth, self.capacity))
        places = []
        for i in todo:
            place = self._ledger.reserve(sizes[i])
            self._ledger.begin_put(objects[i][0], place)
            places.append(place)
        jobs = [(place, objects[i][1]) for i, place in zip(todo, places, strict=True)]
        fits = [self._files.whole_blocks(parts) for _, parts in jobs]
        with self._ledger.using(*(place.segment for place in places)):
            outcomes = await self._in_runs(PWRITEV, jobs, fits)
        for i, place, outcome in zip(todo, places, outcomes, strict=True):
            key = objects[i][0]
            if outcome is None:
                await self._landed(key, place)
            else:
                self._ledger.abandon_put(key, place)
            answers[i] = outcome
        return answers

    async def _in_runs(
        self, op: int, jobs: Sequence[tuple[Place | None, Any]], fits: list[bool]
    ) -> list[Any]:
        """Reads (`PREADV`) or writes (`PWRITEV`) of `jobs` gathered in runs: objects that lie
        back to back in one segment, in file order, move in one request (a batch of blocks put
        together is read back together), by kernel AIO where it can, else in the pool; a job
        that does not `fit` a run (not laid out for one) stands alone. A job with no place
        answers None."""
        order = sorted(
            (i for i, (place, _) in enumerate(jobs) if place is not None),
            key=lambda i: (jobs[i][0].segment.seq, jobs[i][0].offset),  # type: ignore[union-attr]
        )
        runs: list[list[int]] = []
        run_bytes = 0
        for i in order:
            place = jobs[i][0]
            assert place is not None
            if runs and fits[i] and fits[runs[-1][-1]] and len(runs[-1]) < _MAX_RUN:
                last = jobs[runs[-1][-1]][0]
                assert last is not None
                if (
                    last.segment is place.segment
                    and last.offset + record_size(last.length) == place.offset
                    and run_bytes + place.length <= _RUN_BYTES
                ):
                    runs[-1].append(i)
                    run_bytes += place.length
                    continue
            runs.append([i])
            run_bytes = place.length
        answers: list[Any] = [None] * len(jobs)
        moved = cast(list[list[tuple[Place, Any]]], [[jobs[i] for i in run] for run in runs])
        done: list[Any] = [None] * len(runs)
        whole = [k for k, run in enumerate(runs) if all(fits[i] for i in run)]
        if whole:
            got_by_aio = await self._aio.move(op, [moved[k] for k in whole], self.timeout)
            for k, got in zip(whole, got_by_aio, strict=True):
                done[k] = got
        rest = [k for k, got in enumerate(done) if got is None]  # in the pool's threads
        if rest:
            work = self._files.write_runs if op == PWRITEV else self._files.read_runs
            got_in_pool = await self._in_groups(work, [moved[k] for k in rest])
            for k, got in zip(rest, got_in_pool, strict=True):
                done[k] = got
        for run, got in zip(runs, done, strict=True):
            for k, i in enumerate(run):
                answers[i] = got if isinstance(got, BaseException) else got[k]
        return answers
