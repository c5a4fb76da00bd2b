"""The file tier's `files` layout: a file per block on a local (NVMe) file system, which any
number of processes may share.

Layout: `<path>/<namespace hex>/<ab>/<cd>/<key hex>.kv`, fanned out by the key's first two
bytes. A write goes to a temporary file in the same directory and is given its name only if
the name is free (`tiers.file.once`), so a reader sees a whole object or none, a key is written
once however many engines write it at the same time (the others' puts are `duplicates`), and a
crash leaves at most a temporary file, removed once it is an hour old. The index (key -> size,
least recently used first) is rebuilt at start by reading every file's header, so a restart
keeps every complete block.

A directory other processes write (`tiers.file.shared`: they hold member files) is asked about
keys the index lacks: `knows` answers None for them, `contains` looks them up on the disk in
one pool call, and `get` reads the file whatever the index says; a key found enters the index,
a key whose file is gone leaves it. With a `capacity`, the directory's one sweeper keeps every
namespace under `path` within it, least recently used first (file mtimes, which hits refresh),
and a put reserves room first (`TierFull` when there is none in time).

I/O runs in a bounded thread pool (`tiers.file.block_io`). With O_DIRECT (when the file system
allows it; probed at start and said once in the log) objects are written and read through
page-aligned buffers and the payload starts 4 KiB into the file; otherwise through the page
cache, reading payloads straight into the caller's buffer. A free-space guard refuses puts
(`TierFull`) before the disk fills.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tiering.errors import CorruptObject, TierError, TierFull
from tiering.keys import BlockKey, key_from_hex, key_path
from tiering.tier import Buffer, ObjectInfo, TierStat
from tiering.tier.batching import RawRead, RawWrite
from tiering.tier.counters import EVICTIONS
from tiering.tier.format import REMOVABLE, Header, check_object, decode_header
from tiering.tier.options import TierOptions, option
from tiers.file.base import FileOptions, FileTier, log
from tiers.file.block_io import BlockFiles, object_size
from tiers.file.direct import BLOCK
from tiers.file.shared import SharedDirectory

__all__ = ["FULL_WAIT", "TMP_MAX_AGE", "BlockFileTier", "FilesOptions"]

_SUFFIX = ".kv"
_REFUSED = 4096
"""Keys of objects refused and left in place (a neighbour's) that a tier remembers, so a
directory check does not bring them back into its index."""
FULL_WAIT = 2.0
"""The longest a put waits for the sweeper to make room (at most half the tier's deadline)
before it is `TierFull`."""
TMP_MAX_AGE = 3600.0
"""Seconds after which a start-up scan takes a temporary file for a write that never ended (a
write lasts at most its tier's deadline). Its age, never its writer's pid, decides: a writer in
another container has a pid that means nothing, or another process, in this pid namespace."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FilesOptions(FileOptions):
    """The options of the `files` layout (any thread: a value): those of every layout."""

    layout: str = option(
        "files",
        choices=("files",),
        help="A file per block; any number of engines may share the directory (with a "
        "`capacity`, it bounds the directory, every namespace in it).",
    )


class BlockFileTier(FileTier, layout="files"):
    """Runtime thread (the event loop): the file tier with a file per block under `path`;
    file I/O in the pool's threads, the shared directory's housekeeping in its own
    (`tiers.file.shared`). The index is only touched on the loop thread."""

    Options: ClassVar[type[TierOptions]] = FilesOptions
    writes_once = True  # a key's file is named once (`tiers.file.once`)
    _objects = "**/*" + _SUFFIX

    def __init__(self, **options: Any) -> None:
        """`options`: those of `FilesOptions`, as `FileTier` says."""
        super().__init__(**options)
        self._index: OrderedDict[BlockKey, int] = OrderedDict()
        self._bytes = 0
        self._refused: OrderedDict[BlockKey, None] = OrderedDict()
        self._rebuild_index()
        self._shared = SharedDirectory(
            base=self.base,
            own=self.root,
            namespace=self.namespace,
            ident=self.writer,
            name=self.name,
            read_only=self.read_only,
            capacity=self.capacity,
            tmp_max_age=TMP_MAX_AGE,
            # within a put's deadline, whose thread a deadline does not stop
            full_wait=min(FULL_WAIT, self.timeout / 2) if self.timeout else FULL_WAIT,
            evicted=self._count_evictions,
            mac=self.envelope.mac,
        )
        self._gone = self._shared.gone
        if self.capacity is None:  # the directory's, recorded by its first writer with one
            self.capacity = self._shared.capacity
        self._files = BlockFiles(
            name=self.name,
            direct=self.direct,
            fsync=self.fsync,
            buffers=self._buffers,
            check_free=self._check_free,
            gather=self._gather,
            shared=self._shared,
            recency=self.capacity is not None and not self.read_only,
        )

    # -- start-up -------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Index every complete object under the namespace's directory. Objects that fail
        their header check are not indexed and are listed in `damaged` (for `kvtier verify`);
        a writable tier removes those whose damage is provable (`tiering.tier.format.REMOVABLE`)
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
                check_object(header, object_size(raw, st.st_size))
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

    def _knows(self, key: BlockKey) -> bool | None:
        """From the index; None for a key it lacks while other processes write the directory
        (ask `contains`)."""
        if key in self._index:
            return True
        return False if self._shared.alone else None

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        self._drop_gone()
        blob = await self._run(self._files.read, self._path(key), limit)
        self._found(key, None if blob is None else len(blob))
        return blob

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        self._drop_gone()
        got = await self._run(self._files.read_into, self._path(key), payload, limit)
        self._found(key, _length(got, len(payload)))
        return got

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        return await self._run(self._files.read_head, self._path(key), n)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool:
        size = sum(len(p) for p in parts)
        if self.capacity is not None and size > self.capacity:
            raise TierFull(f"tier {self.name!r}: an object of {size} bytes exceeds the capacity")
        written = await self._run(self._files.write, self._path(key), parts, size)
        if written or key not in self._refused:  # (a refused neighbour's object stays unknown)
            self._add_to_index(key, size)  # written now, or by another engine before
        return written

    async def _delete(self, key: BlockKey) -> bool:
        self._forget(key)
        return await self._run(self._files.remove, self._path(key))

    async def _delete_refused(self, key: BlockKey, seen: bytes | None) -> bool:
        if seen is None:
            return await self._delete(key)
        self._forget(key)
        return await self._run(self._files.remove_if, self._path(key), seen)

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """From the index; keys it lacks, when other processes write the directory, from the
        disk, in one pool call (a key found enters the index)."""
        self._drop_gone()
        index = self._index
        found = [key in index for key in keys]
        if self._shared.alone or all(found):
            return found
        ask = [i for i, here in enumerate(found) if not here and keys[i] not in self._refused]
        if ask:
            sizes = await self._run(self._files.sizes, [self._path(keys[i]) for i in ask])
            for i, size in zip(ask, sizes, strict=True):
                if size is not None:
                    self._add_to_index(keys[i], size)
                    found[i] = True
        return found

    async def _stat(self) -> TierStat:
        self._drop_gone()
        return await super()._stat()

    async def _list(self) -> AsyncIterator[BlockKey]:
        self._drop_gone()
        async for key in super()._list():
            yield key

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        self._drop_gone()
        for key in list(self._index):
            try:
                st = await self._run(os.stat, self._path(key))
            except FileNotFoundError:
                continue
            yield ObjectInfo(key, st.st_size, st.st_mtime)

    async def _refuse(self, key: BlockKey, error: CorruptObject) -> None:
        """As `Tier._refuse`; the key leaves the index either way, and one left in place (a
        neighbour's) is remembered, so a directory check does not bring it back."""
        self._forget(key)
        if not self.removable(error):
            self._refused[key] = None
            if len(self._refused) > _REFUSED:
                self._refused.popitem(last=False)
        await super()._refuse(key, error)

    async def _close(self) -> None:
        await super()._close()  # the pool's calls end first: they take and give room
        self._shared.close()

    # -- batches: one thread hop per group of blocks ----------------------------------------------

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead] | None:
        """Reads in at most `concurrency` groups, each group in one pool call (a hop between
        threads costs about as much as reading a block: BENCHMARKS.md, "Secondary tiers against
        raw baselines"); each answer as `_read_into`'s, verified by the base."""
        if len(keys) < 2 or self.codec != "raw":
            return None
        self._drop_gone()
        jobs = [
            (self._path(key), view, limit, key)
            for key, view, limit in zip(keys, payloads, limits, strict=True)
        ]
        answers = await self._in_groups(self._read_group, jobs)
        for key, view, answer in zip(keys, payloads, answers, strict=True):
            if answer is None:
                self._found(key, None)
            elif isinstance(answer, Header):
                self._found(key, answer.object_length)
            elif isinstance(answer, tuple):
                self._found(key, _length(answer, len(view)))
        return answers

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        """Writes in at most `concurrency` groups, each group in one pool call."""
        if len(objects) < 2:
            return None
        sizes, answers, todo = self._room_for(objects)
        jobs = [(self._path(objects[i][0]), objects[i][1], sizes[i]) for i in todo]
        for i, outcome in zip(todo, await self._in_groups(self._write_group, jobs), strict=True):
            if isinstance(outcome, bool):
                self._add_to_index(objects[i][0], sizes[i])
            answers[i] = outcome
        return answers

    def _read_group(self, jobs: list[tuple[Path, memoryview, int, BlockKey]]) -> list[RawRead]:
        """Each object read into its view where it is laid out for it, in the pool, and a placed
        payload opened there by the tier's envelope as soon as it is in (`RawRead`): the loop
        then only counts, and the checks of one group overlap the reads of the others."""
        out: list[RawRead] = []
        for path, view, limit, key in jobs:
            try:
                answer = self._files.read_into(path, view, limit)
                if answer is not None and answer[1]:
                    out.append(self.envelope.open_placed(key, answer[0], view))
                else:
                    out.append(answer)
            except TierError as e:  # a `CorruptObject` too: refused by the base
                out.append(e)
        return out

    def _write_group(self, jobs: list[tuple[Path, Sequence[Buffer], int]]) -> list[Any]:
        out: list[Any] = []
        for path, parts, size in jobs:
            try:
                out.append(self._files.write(path, parts, size))
            except TierError as e:
                out.append(e)
        return out

    # -- bookkeeping on the loop thread ---------------------------------------------------------

    def _bytes_used(self) -> int:
        return self._bytes

    def _add_to_index(self, key: BlockKey, size: int) -> None:
        """Record an object on the disk (the most recently used). The index holds at most a
        capacity of objects: beyond, its least recently used entries are another engine's
        sweeper's evictions this tier has not read since (forgotten, not removed: a check of
        the directory finds one still there)."""
        self._bytes += size - self._index.pop(key, 0)
        self._index[key] = size
        if self.capacity is not None:
            while self._bytes > self.capacity and len(self._index) > 1:
                self._bytes -= self._index.popitem(last=False)[1]

    def _found(self, key: BlockKey, size: int | None) -> None:
        """A read found the object of `key` (of `size` bytes: now the most recently used;
        one another process wrote enters the index) or, with None, found it gone (another
        process removed it: it leaves the index)."""
        if size is None:
            self._forget(key)
        elif key in self._index:
            self._index.move_to_end(key)
        else:
            self._add_to_index(key, size)

    def _forget(self, key: BlockKey) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _drop_gone(self) -> None:
        """Drop from the index the keys the sweeper evicted (queued from its thread)."""
        gone = self._gone
        while gone:
            self._forget(gone.popleft())

    def _count_evictions(self, n: int) -> None:
        self.counters[EVICTIONS] += n  # (the housekeeping thread: one writer of the key)


def _length(got: tuple[Buffer, bool] | None, payload: int) -> int | None:
    """The object's length from what a read into a `payload`-byte buffer answered."""
    if got is None:
        return None
    data, placed = got
    return len(data) + payload if placed else len(data)


def _abandoned(path: Path, now: float) -> bool:
    """Whether a temporary file is older than `TMP_MAX_AGE` (its write never ended)."""
    try:
        return now - path.stat().st_mtime > TMP_MAX_AGE
    except FileNotFoundError:
        return False
