"""The primary region's prefault: maps a region's pages writable ahead of the first copies, on
its own background thread (`kvtier-prefault`, at nice 19), started and stopped by the
`PrimaryRegion` that holds it.

A first write to a fresh page of shared memory costs the kernel an allocation, zeroing and a
page-table entry per page; `MADV_POPULATE_WRITE` (Linux 5.14 and later) does that work here
instead, in chunks of at most `PREFAULT_CHUNK` bytes, so that a stop ends within one chunk.
What it costs and saves: BENCHMARKS.md ("Time to first token").
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from tiers.region.file import PAGE, RegionLayout

__all__ = ["PREFAULT_CHUNK", "Prefault", "shard_pages"]

log = logging.getLogger("tiers.region")  # every line about the region under one logger

_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
PREFAULT_CHUNK = 16 << 20
"""Bytes mapped per call: a stopping prefault ends within one chunk (a few ms)."""


class Prefault:
    """The prefault of one process's mapping of a region: started on the caller's thread, runs
    on its own background thread; `stop` joins it (within one chunk)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, base: int, layout: RegionLayout, rank: int | None, what: object) -> bool:
        """Map the pages of the slots at address `base` writable, slot 0 first; with `rank`,
        only that worker's shard of each slot. `what` names the region in log lines.

        Returns False (nothing started) where the kernel lacks MADV_POPULATE_WRITE."""
        madvise = _madvise()
        if madvise is None:
            return False
        if rank is None or layout.num_workers == 1:  # one worker's shards fill every slot
            total = layout.num_slots * layout.slot_stride
            ranges: Iterator[tuple[int, int]] = (
                (base + at, min(PREFAULT_CHUNK, total - at))
                for at in range(0, total, PREFAULT_CHUNK)
            )
        else:
            ranges = shard_pages(base, layout, rank)  # listed on the thread, as it goes
        first = next(ranges, None)
        if first is None or madvise(first[0], first[1], _MADV_POPULATE_WRITE) != 0:
            log.debug("primary region %s: MADV_POPULATE_WRITE unavailable", what)
            return False
        stop = self._stop

        def run() -> None:
            with contextlib.suppress(OSError):  # the engine's threads come first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            for address, length in ranges:
                if stop.is_set() or madvise(address, length, _MADV_POPULATE_WRITE) != 0:
                    return

        self._thread = threading.Thread(target=run, name="kvtier-prefault", daemon=True)
        self._thread.start()
        return True

    def done(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the prefault; whether it has ended (or none runs)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def stop(self) -> None:
        """Stop the thread and wait for it (within one chunk: never unmap under it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _madvise() -> Any:
    """libc's madvise through ctypes (a foreign call: the GIL is released while the kernel
    maps), or None where there is no libc to call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def shard_pages(base: int, layout: RegionLayout, rank: int) -> Iterator[tuple[int, int]]:
    """(address, length) of the pages holding worker `rank`'s shard of each slot, merged where
    consecutive slots' ranges touch, in chunks of at most `PREFAULT_CHUNK`."""
    start = rank * layout.shard_bytes
    run_start = run_end = -1
    for slot in range(layout.num_slots):
        first = base + slot * layout.slot_stride + start
        low = first - first % PAGE
        high = first + layout.shard_bytes
        high += -high % PAGE
        if low <= run_end:
            run_end = max(run_end, high)
        else:
            if run_end > run_start:
                yield run_start, run_end - run_start
            run_start, run_end = low, high
        while run_end - run_start > PREFAULT_CHUNK:
            yield run_start, PREFAULT_CHUNK
            run_start += PREFAULT_CHUNK
    if run_end > run_start:
        yield run_start, run_end - run_start
