"""The segment layout's reads and writes by kernel AIO from the event loop (`tiers.file.aio`).

Runs of objects (back to back in one segment, each laid out as a 4 KiB header and whole blocks) go
to the disk as one request each, a batch's runs in one submission, with no thread in between (why:
BENCHMARKS.md, "Secondary tiers against raw baselines"). What the kernel cannot do, or would block
on, is left to the thread pool (`SegmentFiles`): a file not opened yet (opening and preallocating
are the pool's), a write past a file's preallocated blocks, a read-only buffer, no free header page,
`fsync`, and every request the kernel answers with one of `REDO`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
from collections import Counter
from pathlib import Path
from typing import Any

from tiering.errors import TierFull, TierTimeout
from tiers.file.aio import PREADV, PWRITEV, REDO, KernelAio
from tiers.file.direct import BLOCK
from tiers.file.ledger import Place, SegmentLedger
from tiers.file.segment_io import SegmentFiles, read_answers

__all__ = ["SegmentAio"]

log = logging.getLogger(__name__)

_DEPTH = 256  # requests in flight in the kernel AIO context (the manager's max_inflight)


class SegmentAio:
    """Runtime thread (the event loop): the tier's kernel AIO context, made at first use."""

    def __init__(
        self,
        *,
        name: str,
        root: Path,
        enabled: bool,
        direct: bool,
        fsync: bool,
        files: SegmentFiles,
        ledger: SegmentLedger,
        counters: Counter[str],
    ) -> None:
        self.name = name
        self.root = root
        self.enabled = enabled
        self.direct = direct
        self.fsync = fsync
        self.context: KernelAio | None = None
        self.off = ""
        """Why kernel AIO is not used, once known."""
        self._files = files
        self._ledger = ledger
        self._counters = counters
        self._pages: list[memoryview] = []  # free 4 KiB aligned headers

    def _bound(self) -> KernelAio | None:
        """The kernel AIO context, bound to the running loop; None where there is none, or it
        is busy with another loop's calls."""
        if self.off:
            return None
        if self.context is None:
            if not self.direct or not self.enabled:
                self.off = "buffered I/O" if self.enabled else "aio: false"
                return None
            try:
                self.context = KernelAio(_DEPTH)
            except OSError as e:
                self.off = str(e)
                log.info("tier %r: no kernel AIO (%s): I/O goes through threads", self.name, e)
                return None
            pages = memoryview(mmap.mmap(-1, _DEPTH * BLOCK))
            self._pages = [pages[i * BLOCK : (i + 1) * BLOCK] for i in range(_DEPTH)]
        return self.context if self.context.bind(asyncio.get_running_loop()) else None

    async def move(
        self, op: int, runs: list[list[tuple[Place, Any]]], deadline: float | None = None
    ) -> list[list[Any] | None]:
        """Runs of objects (a view to read into, or a header and payload to write, each) read
        (`PREADV`) or written (`PWRITEV`), one request per run, all submitted at once. A run's
        answers are those `SegmentFiles.read_runs` / `write_runs` give; None for a run left to
        the pool. `deadline`: seconds per run, for batches (None: the caller's holds)."""
        out: list[list[Any] | None] = [None] * len(runs)
        aio = None if op == PWRITEV and self.fsync else self._bound()
        if aio is None:
            return out
        requests = []
        chosen: list[tuple[int, list[memoryview], int]] = []  # run, its headers, its bytes
        for k, run in enumerate(runs):
            first = run[0][0]
            fd = self._files.fds.get(first.segment.seq)  # opening is the pool's
            last = run[-1][0]
            if op == PWRITEV and not self._files.allocated(first, last.offset + last.length):
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
        try:
            with self._ledger.using(*(runs[k][0][0].segment for k, _, _ in chosen)):
                try:
                    if deadline is None:
                        results = await aio.wait(aio.submit(requests))
                    else:
                        async with asyncio.timeout(deadline * len(runs)):
                            results = await aio.wait(aio.submit(requests))
                except TimeoutError:
                    error = TierTimeout(f"tier {self.name!r}: no answer within the deadline")
                    for k, _, _ in chosen:
                        out[k] = [error] * len(runs[k])
                    return out
                self._counters["aio_requests"] += len(requests)
                for (k, pages, total), n in zip(chosen, results, strict=True):
                    out[k] = self._answers(op, runs[k], pages, n, total)
                    if out[k] is None:
                        self._counters["aio_redone"] += 1
                return out
        finally:
            for _, pages, _ in chosen:
                self._pages += pages

    def _answers(
        self, op: int, run: list[tuple[Place, Any]], pages: list[memoryview], n: int, total: int
    ) -> list[Any] | None:
        """A run's answers from its request's result `n` (bytes, or a negative errno; `total`
        bytes were asked for); None: redo it in the pool."""
        first = run[0][0]
        if n < 0 and -n in REDO:
            if -n != errno.EAGAIN and not self.off:  # the file system cannot: stop asking
                self.off = os.strerror(-n)
                log.info(
                    "tier %r: kernel AIO refused by %s (%s): I/O goes through threads",
                    self.name,
                    self.root,
                    self.off,
                )
            return None
        if n < 0:
            e = OSError(-n, os.strerror(-n))
            if op == PWRITEV and -n in (errno.ENOSPC, errno.EDQUOT):
                full = TierFull(f"tier {self.name!r}: disk full writing {first.segment.path}")
                return [full] * len(run)
            what = "read" if op == PREADV else "write"
            return [self._files.unavailable(what, first, e)] * len(run)
        if op == PREADV:
            return read_answers(run, pages, n)
        if n != total:
            short = OSError(errno.EIO, f"short write ({n} of {total})")
            return [self._files.unavailable("write", first, short)] * len(run)
        return [None] * len(run)

    def close(self) -> None:
        """Wait for the requests in flight (the kernel writes into callers' buffers until
        then) and release the context."""
        if self.context is not None:
            self.context.close()
