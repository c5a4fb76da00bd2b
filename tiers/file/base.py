"""What both layouts of the file tier share: the directory, O_DIRECT or buffered I/O, the
free-space guard, the thread pool and the batch plumbing.

A layout is a subclass that names itself (`class BlockFileTier(FileTier, layout="files")`);
`FileTier.variant(options)` picks the class of the `layout` an options mapping asks for, and
each layout accepts only its own options. The layouts keep their own index (`_index`: every
key the tier holds, oldest first; `tiers.indexed.IndexedTier` answers from it) and count their
own bytes (`_bytes_used`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from tiering.errors import ConfigError, TierError, TierFull, TierTimeout
from tiering.keys import BlockKey
from tiering.tier import Buffer, Medium, NamespaceUsage
from tiering.tier.batching import RawWrite
from tiering.tier.counters import corrupt
from tiering.tier.options import TierOptions, fields_of, option
from tiering.tier.threads import IOThreads
from tiers.file.direct import (
    BLOCK,
    BounceBuffers,
    direct_readable,
    direct_supported,
    is_aligned,
    round_up,
)
from tiers.file.records import delete_record, list_records, read_record, write_record
from tiers.file.usage import FileUsage
from tiers.indexed import IndexedTier

__all__ = ["LAYOUTS", "FileOptions", "FileTier"]

log = logging.getLogger(__name__)
T = TypeVar("T")

LAYOUTS = ("files", "segments")
_said_buffered: set[str] = set()


@dataclass(frozen=True, kw_only=True, slots=True)
class FileOptions(TierOptions):
    """The options of every layout of the file tier (any thread: a value); each layout's record
    subclasses it."""

    path: str = option(kind="path", what="a directory path", help="The directory of the tier.")
    layout: str = option(
        "files",
        choices=LAYOUTS,
        help="`files`: a file per block; `segments`: blocks appended to segment files.",
    )
    min_free: int = option(
        1 << 30,
        kind="size",
        zero=True,
        help="Puts fail (TierFull) rather than leave less free space on the disk.",
    )
    direct: bool | None = option(
        None, help="Use O_DIRECT (null: when the file system supports it)."
    )
    fsync: bool = option(
        False,
        help="Flush each object and its directory before a put returns (survives power loss).",
    )


class FileTier(IndexedTier):
    """Runtime thread (the event loop): the base of the file tier's layouts; file I/O runs in
    a pool of `concurrency` threads. The index is only touched on the loop thread."""

    type_name = "file"
    persistent = True
    medium = Medium.DISK
    evicts = True
    align = BLOCK
    indexed = True
    """The index holds what the tier found at start and what it wrote and read since; the
    `files` layout asks its directory about keys the index lacks while other processes write
    there (its `knows` answers None for them); the `segments` layout has one writer."""

    Options: ClassVar[type[TierOptions]] = FileOptions
    options: FileOptions
    layout: ClassVar[str] = ""
    """The `layout` option's value that chooses this class."""
    _layouts: ClassVar[dict[str, type[FileTier]]] = {}
    _objects: ClassVar[str] = ""
    """Where a namespace directory's objects are (relative glob)."""

    _index: dict[BlockKey, Any]
    """Every key the tier holds, oldest first (set by the layout)."""

    def __init_subclass__(cls, *, layout: str = "", **kwargs: Any) -> None:
        """A layout's class names its layout: `class X(FileTier, layout="files")`."""
        super().__init_subclass__(**kwargs)
        if layout:
            assert layout in LAYOUTS and layout not in FileTier._layouts, layout
            cls.layout = layout
            FileTier._layouts[layout] = cls

    @classmethod
    def variant(cls, options: Mapping[str, Any]) -> type[FileTier]:
        """The class of the layout `options` asks for (`files` when it names none); ConfigError
        for an unknown layout, or for an option of another layout than the one chosen."""
        layout = options.get("layout", cls.layout or "files")
        chosen = FileTier._layouts.get(layout) if isinstance(layout, str) else None
        if chosen is None:
            raise ConfigError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
        if cls.layout and chosen is not cls:
            raise ConfigError(f"layout: {cls.__name__} is layout {cls.layout}, got {layout!r}")
        chosen.refuse_other_options(options)
        return chosen

    @classmethod
    def refuse_other_options(cls, options: Mapping[str, Any]) -> None:
        """ConfigError for an option of another layout than this one (rather than "unknown
        option": it is known, to the other layout)."""
        own = fields_of(cls.Options)
        for other in FileTier._layouts.values():
            for name in fields_of(other.Options):
                if name in options and name not in own:
                    raise ConfigError(
                        f"{name}: an option of layout {other.layout}, not of layout {cls.layout}"
                    )

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        name: str | None = None,
        options: FileOptions | None = None,
        **values: Any,
    ) -> None:
        """`options` (the layout's record, `Options`) and/or `values` (its fields): as
        `Tier`'s; ConfigError for another layout, or an option of another layout."""
        if options is None:
            self.variant(values)
        else:  # (the record is this layout's, or `Tier` refuses it)
            self.refuse_other_options(values)
        super().__init__(namespace=namespace, name=name, secret=secret, options=options, **values)
        opts = self.options
        assert isinstance(opts, FileOptions)
        path = opts.path
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
        self.min_free = opts.min_free
        self.fsync = opts.fsync
        direct = opts.direct
        if direct is None:
            if self.read_only:
                direct = direct_readable(self.root, self._objects)
            else:
                direct = direct_supported(self.base)
        self.direct = direct
        if not self.direct and str(self.base) not in _said_buffered:
            _said_buffered.add(str(self.base))
            log.info(
                "tier %r: %s does not support O_DIRECT; using buffered I/O", self.name, self.base
            )
        self._pool = IOThreads(self.concurrency, f"kvtier-{self.name}")
        self._buffers = BounceBuffers()  # one aligned bounce buffer per pool thread
        # a cancelled scan returns at once (it uses no caller's buffer) and stops by itself
        self._usage_scan = FileUsage(self.base, self.layout, self._pool.run)

    # -- start-up -------------------------------------------------------------------------------

    def _damaged_at_start(self, where: str, reason: str, detail: str, *, removed: bool) -> None:
        """A damaged object the start-up scan found at `where`, counted, listed in `damaged`
        and logged with what happens to it: `removed` (by the caller) or left in place."""
        self.counters[corrupt(reason)] += 1
        self.damaged.append((where, reason, removed))
        verb = "removing" if removed else "leaving"
        log.warning("tier %r: %s a damaged object at start, %s: %s", self.name, verb, where, detail)

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

    async def _usage(self) -> list[NamespaceUsage]:
        """Every namespace directory under `path`, whoever wrote it (`tiers.file.usage`)."""
        own = (self.namespace, len(self._index)) if self.layout == "segments" else None
        tally = await self._usage_scan.scan(own)
        return tally.result(self.name)

    async def _read_record(self, name: str, limit: int) -> Buffer | None:
        try:
            return await self._run(read_record, self.base, self.namespace, name, limit)
        except OSError as e:
            raise TierError(f"tier {self.name!r}: record {name}: {e}") from e

    async def _write_record(self, name: str, blob: bytes) -> bool:
        try:
            return await self._run(write_record, self.base, self.namespace, name, blob)
        except OSError as e:
            raise TierError(f"tier {self.name!r}: record {name}: {e}") from e

    async def _delete_record(self, name: str) -> bool:
        try:
            return await self._run(delete_record, self.base, self.namespace, name)
        except OSError as e:
            raise TierError(f"tier {self.name!r}: record {name}: {e}") from e

    async def _list_records(self, prefix: str, limit: int) -> list[str]:
        try:
            return await self._run(list_records, self.base, self.namespace, prefix, limit)
        except OSError as e:
            raise TierError(f"tier {self.name!r}: records: {e}") from e

    async def _close(self) -> None:
        self._pool.shutdown()

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        """`function` in the pool. Cancelled (a deadline), it still waits for the thread: the
        thread reads into and writes from the caller's buffers (primary slots), which must not
        be handed to anyone else while it runs. The caller's deadline comes late instead."""
        return await self._pool.run_to_end(function, *args)

    # -- batches --------------------------------------------------------------------------------

    def _room_for(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> tuple[list[int], list[RawWrite], list[int]]:
        """A batch write's object sizes, its answers so far (an object larger than the
        capacity fails alone, `TierFull`) and the indexes of the objects to write."""
        sizes = [sum(len(p) for p in parts) for _, parts in objects]
        answers: list[RawWrite] = [None] * len(objects)
        todo = []
        for i, size in enumerate(sizes):
            if self.capacity is not None and size > self.capacity:
                answers[i] = TierFull(
                    f"tier {self.name!r}: an object of {size} bytes exceeds the capacity"
                )
            else:
                todo.append(i)
        return sizes, answers, todo

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

    # -- file I/O, in the pool -------------------------------------------------------------------

    def _check_free(self, size: int) -> None:
        fs = os.statvfs(self.base)
        free = fs.f_bavail * fs.f_frsize
        if free - size < self.min_free:
            raise TierFull(
                f"tier {self.name!r}: {free} bytes free on {self.root}; a put of {size} would "
                f"leave less than min_free ({self.min_free})"
            )

    def _aligned_buffer(self, size: int) -> memoryview:
        """This thread's page-aligned buffer, `size` bytes of it (`BounceBuffers`)."""
        return self._buffers.get(size)

    def _gather(self, parts: Sequence[Buffer], size: int) -> list[Buffer]:
        """The buffers one write of an object sends: with O_DIRECT, page-aligned and whole
        4 KiB blocks (a primary slot's payload goes as it is, behind an aligned copy of the
        header; anything else through this thread's bounce buffer, zero-padded)."""
        if not self.direct:
            return [memoryview(p) for p in parts]
        if len(parts) == 2 and len(parts[0]) == BLOCK and is_aligned(memoryview(parts[1])):
            header = self._aligned_buffer(BLOCK)
            header[:] = parts[0]
            return [header, parts[1]]
        buffer = self._aligned_buffer(round_up(size))
        at = 0
        for part in parts:
            buffer[at : at + len(part)] = part
            at += len(part)
        buffer[at:] = bytes(len(buffer) - at)  # no stale bytes in the padding
        return [buffer]
