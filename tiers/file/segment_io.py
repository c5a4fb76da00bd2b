"""The segment layout's reads and writes through the tier's thread pool.

Segment files are opened once, by the pool thread that first needs one, and kept open; a new
segment file is preallocated (`posix_fallocate`) where the file system can. Objects back to
back in one segment (a batch put together) move in one `preadv` / `pwritev` (a run); a run of
one also takes objects not laid out as a 4 KiB header and whole blocks. Everything here raises
the tier's errors (`TierUnavailable`, `TierFull`, `CorruptObject`) or answers them as values in a
batch, one per object.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiering.errors import CorruptObject, TierError, TierFull, TierUnavailable
from tiering.tier import Buffer
from tiering.tier.format import peek_lengths
from tiers.file.direct import BLOCK, BounceBuffers, is_aligned, unlink
from tiers.file.ledger import Place, Segment, SegmentLedger, record_size
from tiers.file.recovery import TOMB, TOMBSTONE

__all__ = ["SegmentFiles", "close_and_unlink", "read_answers"]

log = logging.getLogger(__name__)


class SegmentFiles:
    """Pool threads (and the loop thread at start and close): the open segment files and the
    I/O on them. `read_only` follows the tier's (a read-only tier opens files read-only)."""

    def __init__(
        self,
        *,
        name: str,
        root: Path,
        direct: bool,
        fsync: bool,
        read_only: bool,
        ledger: SegmentLedger,
        buffers: BounceBuffers,
        check_free: Callable[[int], None],
        gather: Callable[[Sequence[Buffer], int], list[Buffer]],
    ) -> None:
        self.name = name
        self.root = root
        self.direct = direct
        self.fsync = fsync
        self.read_only = read_only
        self.fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._ledger = ledger
        self._buffers = buffers
        self._check_free = check_free
        self._gather = gather

    # -- files ----------------------------------------------------------------------------------

    def fd(self, segment: Segment) -> int:
        """The descriptor of `segment`'s file, opened (created, for the active segment of a
        writable tier, and preallocated) by the first thread that needs it."""
        fd = self.fds.get(segment.seq)
        if fd is None:
            with self._fd_lock:
                fd = self.fds.get(segment.seq)
                if fd is None:
                    if self.read_only:
                        flags = os.O_RDONLY
                    else:
                        flags = os.O_RDWR | os.O_CREAT
                        if not self.root.is_dir():
                            self.root.mkdir(parents=True, exist_ok=True)
                    direct = os.O_DIRECT if self.direct else 0
                    fd = os.open(segment.path, flags | direct, 0o644)
                    if segment is self._ledger.active and not self.read_only:
                        self._preallocate(fd, segment)
                    self.fds[segment.seq] = fd
        return fd

    def _preallocate(self, fd: int, segment: Segment) -> None:
        """Give a new segment file its blocks up front (`posix_fallocate`): appending O_DIRECT
        writes extend the file and serialize on its metadata, writes inside it do not
        (BENCHMARKS.md, "Secondary tiers against raw baselines"). Skipped where the file system
        cannot, or when it would leave less than `min_free`; the unused tail is zeros, trimmed on
        close and skipped by a restart's scan. Best effort: it never raises (the caller has just
        opened `fd` and would leak it); a segment left unallocated is still counted at
        `segment_size`, which errs towards evicting early."""
        ledger = self._ledger
        if not ledger.preallocating:
            return
        try:
            if os.fstat(fd).st_size:
                return
            self._check_free(ledger.segment_size)
            os.posix_fallocate(fd, 0, ledger.segment_size)
        except TierFull:
            return
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                ledger.preallocating = False
                log.info("tier %r: %s cannot preallocate files (%s)", self.name, self.root, e)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an ENOSPC may leave part of it allocated
            return
        segment.preallocated = True

    def laid_out(self, place: Place, view: memoryview) -> bool:
        """Whether a read of `place` can place its payload straight into `view` (in a run)."""
        return (
            place.length == BLOCK + len(view)
            and len(view) % BLOCK == 0
            and (not self.direct or is_aligned(view))
        )

    def whole_blocks(self, parts: Sequence[Buffer]) -> bool:
        """Whether an object goes to disk from where its parts lie (in a run): a 4 KiB header,
        then a payload of whole blocks (page-aligned with O_DIRECT)."""
        return (
            len(parts) == 2
            and len(parts[0]) == BLOCK
            and len(parts[1]) % BLOCK == 0
            and (not self.direct or is_aligned(memoryview(parts[1])))
        )

    def allocated(self, place: Place, end: int) -> bool:
        """Whether `place`'s segment file had its bytes up to `end` allocated when created (a
        write there takes no more space, and extends nothing)."""
        return place.segment.preallocated and end <= self._ledger.segment_size

    def close(self) -> None:
        """Close every file, the active one trimmed to its objects (the preallocated tail goes
        back to the disk; a restart scans less)."""
        active = self._ledger.active
        if active is not None and active.preallocated and active.seq in self.fds:
            try:
                os.ftruncate(self.fds[active.seq], active.size)
            except OSError as e:
                log.warning("tier %r: cannot trim %s: %s", self.name, active.path, e)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def unavailable(self, what: str, place: Place, e: OSError) -> TierUnavailable:
        return TierUnavailable(
            f"tier {self.name!r}: cannot {what} {place.segment.path} at {place.offset}: "
            f"{e.strerror or e}"
        )

    # -- one object -----------------------------------------------------------------------------

    def read_object_into(self, place: Place, payload: memoryview) -> tuple[Buffer, bool] | None:
        """(header, True) with the payload read straight into `payload` when the object is
        laid out as a 4 KiB header and a block of that size; otherwise (the whole object,
        False), as `ReadsInto` says."""
        if place.length == BLOCK + len(payload) and (not self.direct or is_aligned(payload)):
            header = self._buffers.get(BLOCK)
            try:
                n = os.preadv(self.fd(place.segment), [header, payload], place.offset)
            except OSError as e:
                raise self.unavailable("read", place, e) from e
            if bytes(header[: len(TOMBSTONE)]) == TOMBSTONE:
                return None  # deleted while this read was on its way
            if n < place.length:
                raise CorruptObject("truncated", f"{place.segment.path} ends inside an object")
            if peek_lengths(header) == (BLOCK, len(payload)):
                return bytes(header), True
            # not laid out as we read it (what was read into `payload` is garbage): as it is
        blob = self.read_object(place)
        return None if blob is None else (blob, False)

    def read_object_head(self, place: Place, n: int) -> bytes | None:
        want = min(n, place.length)
        buffer = self._buffers.get(record_size(want))  # O_DIRECT reads whole aligned blocks
        try:
            got = os.preadv(self.fd(place.segment), [buffer], place.offset)
        except OSError as e:
            raise self.unavailable("read", place, e) from e
        head = bytes(buffer[: min(got, want)])
        return None if head.startswith(TOMBSTONE) else head

    def read_object(self, place: Place) -> bytes | None:
        buffer = self._buffers.get(record_size(place.length))
        try:
            n = os.preadv(self.fd(place.segment), [buffer], place.offset)
        except OSError as e:
            raise self.unavailable("read", place, e) from e
        if bytes(buffer[: len(TOMBSTONE)]) == TOMBSTONE:
            return None
        if n < place.length:
            raise CorruptObject("truncated", f"{place.segment.path} ends inside an object")
        return bytes(buffer[: place.length])

    def write_object(self, place: Place, parts: Sequence[Buffer]) -> None:
        if not self.allocated(place, place.offset + place.length):
            self._check_free(place.length)
        self._pwrite(place, self._gather(parts, place.length))

    def _pwrite(self, place: Place, vectors: Sequence[Buffer]) -> None:
        """`vectors` at `place`'s offset, all of them (and flushed with `fsync`)."""
        total = sum(len(v) for v in vectors)
        try:
            fd = self.fd(place.segment)
            written = os.pwritev(fd, vectors, place.offset)
            if written != total:
                raise OSError(errno.EIO, f"short write ({written} of {total})")
            if self.fsync:
                os.fdatasync(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"tier {self.name!r}: disk full writing {place.segment.path}") from e
            raise self.unavailable("write", place, e) from e

    def write_tombstone(self, place: Place) -> None:
        """Write a tombstone over a dead object's header."""
        tomb = self._buffers.get(BLOCK)
        tomb[:] = bytes(BLOCK)
        TOMB.pack_into(tomb, 0, TOMBSTONE, place.length)
        try:
            os.pwritev(self.fd(place.segment), [tomb], place.offset)
            if self.fsync:
                os.fdatasync(self.fd(place.segment))
        except OSError as e:
            raise self.unavailable("delete in", place, e) from e

    # -- runs: objects back to back, one system call ----------------------------------------------

    def read_runs(self, runs: list[list[tuple[Place | None, memoryview]]]) -> list[Any]:
        return _by_run(runs, self._read_alone, self._read_run)

    def write_runs(self, runs: list[list[tuple[Place, Sequence[Buffer]]]]) -> list[Any]:
        return _by_run(runs, self._write_alone, self._write_run)

    def _read_run(self, run: list[tuple[Place, memoryview]]) -> list[Any]:
        """Objects back to back, each a 4 KiB header and a payload read into its view."""
        first = run[0][0]
        pages = self._buffers.get(len(run) * BLOCK)
        headers = [pages[k * BLOCK : (k + 1) * BLOCK] for k in range(len(run))]
        vectors: list[memoryview] = []
        for header, (_, view) in zip(headers, run, strict=True):
            vectors += [header, view]
        try:
            n = os.preadv(self.fd(first.segment), vectors, first.offset)
        except OSError as e:
            raise self.unavailable("read", first, e) from e
        return read_answers(run, headers, n)

    def _write_run(self, run: list[tuple[Place, Sequence[Buffer]]]) -> list[None]:
        first, last = run[0][0], run[-1][0]
        if not self.allocated(first, last.offset + last.length):
            self._check_free(sum(place.length for place, _ in run))
        headers = self._buffers.get(len(run) * BLOCK)
        vectors: list[Buffer] = []
        for k, (_, (header, payload)) in enumerate(run):
            aligned = headers[k * BLOCK : (k + 1) * BLOCK]
            aligned[:] = header
            vectors += [aligned, payload]
        self._pwrite(first, vectors)
        return [None] * len(run)

    def _read_alone(self, jobs: Sequence[tuple[Place | None, memoryview]]) -> list[Any]:
        return _one_by_one(
            jobs, lambda place, view: None if place is None else self.read_object_into(place, view)
        )

    def _write_alone(self, jobs: list[tuple[Place, Sequence[Buffer]]]) -> list[Any]:
        return _one_by_one(jobs, self.write_object)


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
    """`do(place, data)` for each job: its answer, or the `TierError` / `CorruptObject` it
    raised."""
    out: list[Any] = []
    for place, data in jobs:
        try:
            out.append(do(place, data))
        except (TierError, CorruptObject) as e:
            out.append(e)
    return out


def read_answers(
    run: Sequence[tuple[Place, memoryview]], headers: Sequence[memoryview], n: int
) -> list[Any]:
    """Each object's answer to a read of `run` (objects back to back, their 4 KiB headers read
    into `headers`, `n` bytes read in all): (its header, True) as `ReadsInto` says, which the
    tier then verifies; None for a tombstone; `CorruptObject` where the file ended inside it."""
    first = run[0][0]
    answers: list[Any] = []
    for (place, _), page in zip(run, headers, strict=True):
        header = bytes(page)
        if header.startswith(TOMBSTONE):
            answers.append(None)
        elif n < place.offset - first.offset + place.length:
            answers.append(
                CorruptObject("truncated", f"{place.segment.path} ends inside an object")
            )
        else:
            answers.append((header, True))
    return answers


def close_and_unlink(fd: int | None, path: Path) -> None:
    """Close (when open) and remove the file of a segment no call uses any more."""
    if fd is not None:
        os.close(fd)
    unlink(path)
