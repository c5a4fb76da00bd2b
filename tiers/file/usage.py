"""The file tier's store-wide usage, driven from the runtime's loop and scanned in the tier's
pool threads: what every namespace directory under its path holds.

One directory per pool call: a first-level fan-out directory of a namespace (`files` layout) or
a namespace's segment files (`segments` layout), so a deadline ends the scan between two calls
(a call in flight stops at its next entry) and a pool thread is never taken for long.

- `files`: every `<namespace hex>/<ab>/<cd>/<key hex>.kv` regular file: one object, its size,
  its modification time (temporary files, and anything not named as kvtier names objects, are
  left out). No header is read.
- `segments`: every `<namespace hex>/<sequence>.kvs` regular file counts its size (what
  `capacity` counts: a preallocated segment all of it) and its modification time; its objects
  are the records the start-up scan would place (`tiers.file.recovery.scan_segment`: one header
  read per record), counted once per segment file and kept while the file's size and
  modification time stay the same (a sealed segment is read once; a delete's tombstone changes
  it). A block written twice counts twice until its older copy's segment goes. The tier's own
  namespace counts what its index holds instead (it is the directory's one writer).

Names are never followed through symbolic links, and only regular files count: anything a
stranger puts in the directory costs a `stat`, never a read.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from tiering.errors import TierUnavailable
from tiering.keys import key_from_hex
from tiering.tier.usage import MAX_NAMESPACES, UsageTally, namespace_of
from tiers.file.ledger import SUFFIX as SEGMENT_SUFFIX
from tiers.file.ledger import SegmentLedger
from tiers.file.recovery import scan_segment

__all__ = ["FileUsage"]

OBJECT_SUFFIX = ".kv"
MAX_COUNTED_SEGMENTS = 1 << 20
"""Segment files whose record counts are kept between scans (~200 bytes each)."""


class FileUsage:
    """One file tier's usage scans (runtime thread; its methods with `_in_pool` in the tier's
    pool threads). `run` is the tier's pool (`FileTier._run`'s kind: a cancelled call returns
    at once, the scan stops at its next entry)."""

    def __init__(self, base: Path, layout: str, run: Callable[..., Awaitable[Any]]) -> None:
        self.base = base
        self.layout = layout
        self._run = run
        self._records: dict[tuple[str, int, int], int] = {}
        """(segment path, size, mtime in ns) -> records it holds, for `segments`."""

    async def scan(self, own: tuple[bytes, int] | None = None) -> UsageTally:
        """Every namespace under `base`; `own`: (the tier's namespace, the objects its index
        holds), counted from the index (segments)."""
        tally = UsageTally()
        stop = threading.Event()
        try:
            namespaces = await self._call(_namespace_dirs, self.base, stop)
            for namespace, directory in namespaces:
                if self.layout == "segments":
                    counted = own[1] if own is not None and own[0] == namespace else None
                    await self._call(self._tally_segments, namespace, directory, counted, tally)
                    continue
                for first in await self._call(_hex_dirs, directory, stop):
                    await self._call(_tally_objects, namespace, first, tally, stop)
        finally:
            stop.set()  # a call cancelled by a deadline ends at its next entry
        return tally

    async def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return await self._run(function, *args)
        except OSError as e:
            raise TierUnavailable(f"{self.base}: cannot list: {e.strerror or e}") from e

    def _tally_segments(
        self, namespace: bytes, directory: Path, counted: int | None, tally: UsageTally
    ) -> None:
        """In the pool: a namespace's segment files; their records, from the cache, or read."""
        objects = 0
        size = 0
        newest: float | None = None
        seen: set[tuple[str, int, int]] = set()
        for entry in _regular_files(directory):
            name = entry.name
            if not (name.endswith(SEGMENT_SUFFIX) and name[: -len(SEGMENT_SUFFIX)].isdigit()):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # evicted meanwhile
                continue
            size += st.st_size
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
            if counted is None:
                objects += self._segment_records(Path(entry.path), namespace, st, seen)
        inside = str(directory) + os.sep
        for stale in [k for k in self._records if k[0].startswith(inside) and k not in seen]:
            del self._records[stale]
        if counted is not None:
            objects = counted
        if objects or size:
            tally.add(namespace, size, newest, objects)

    def _segment_records(
        self, path: Path, namespace: bytes, st: os.stat_result, seen: set[tuple[str, int, int]]
    ) -> int:
        key = (str(path), st.st_size, st.st_mtime_ns)
        seen.add(key)
        found = self._records.get(key)
        if found is not None:
            return found
        ledger = SegmentLedger(path.parent, 1 << 62, lambda _segment: None)
        segment = ledger.add_found(0, path)
        try:
            scan_segment(segment, ledger, namespace, verify=False, damaged=_ignore)
        except OSError:  # gone meanwhile (evicted), or unreadable: counts what was found
            pass
        found = len(segment.keys)
        if len(self._records) < MAX_COUNTED_SEGMENTS:
            self._records[key] = found
        return found


def _ignore(offset: int, reason: str, detail: str) -> None:
    """A damaged record is no object: the tier's own scan and `kvtier verify` report it."""


def _regular_files(directory: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    yield entry
    except (FileNotFoundError, NotADirectoryError):
        return


def _namespace_dirs(base: Path, stop: threading.Event) -> list[tuple[bytes, Path]]:
    """In the pool: the namespace directories under `base` (32 lowercase hex digits), at most
    `MAX_NAMESPACES`, in name order."""
    found: list[tuple[bytes, Path]] = []
    try:
        with os.scandir(base) as entries:
            for entry in entries:
                if stop.is_set() or len(found) >= MAX_NAMESPACES:
                    break
                namespace = namespace_of(entry.name)
                if namespace is not None and entry.is_dir(follow_symlinks=False):
                    found.append((namespace, Path(entry.path)))
    except FileNotFoundError:  # a read-only tier over a directory not made yet
        return []
    return sorted(found)


def _hex_dirs(directory: Path, stop: threading.Event) -> list[Path]:
    found = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if stop.is_set():
                    break
                name = entry.name
                if len(name) == 2 and name == name.lower() and _hex(name):
                    if entry.is_dir(follow_symlinks=False):
                        found.append(Path(entry.path))
    except (FileNotFoundError, NotADirectoryError):
        pass
    return found


def _tally_objects(namespace: bytes, first: Path, tally: UsageTally, stop: threading.Event) -> None:
    """In the pool: every regular file named like an object under a first-level fan-out
    directory (`ab/*/`) of a namespace."""
    for second in _hex_dirs(first, stop):
        for entry in _regular_files(second):
            if stop.is_set():
                return
            name = entry.name
            if not name.endswith(OBJECT_SUFFIX) or name.startswith(".") or not _is_object(name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted or evicted meanwhile
                continue
            if stat.S_ISREG(st.st_mode):
                tally.add(namespace, st.st_size, st.st_mtime)


def _is_object(name: str) -> bool:
    try:
        key_from_hex(name[: -len(OBJECT_SUFFIX)])
    except ValueError:
        return False
    return True


def _hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
