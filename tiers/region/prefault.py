"""The primary region's prefault: maps a region's pages writable ahead of the first copies,
started and stopped by the `PrimaryRegion` that holds it.

A first write to a fresh page of shared memory costs the kernel an allocation, zeroing and a
page-table entry per page; `MADV_POPULATE_WRITE` (Linux 5.14 and later) does that work here
instead, in chunks of at most `PREFAULT_CHUNK` bytes. Two parts, so that the engine's first
requests never compete with it:

- the slots the pool hands out first (slot 0 first) up to `primary.prefault_sync` bytes, on the
  caller's thread: mapped before the engine serves;
- the rest on a background thread (`kvtier-prefault`, at nice 19) that yields to the engine: it
  maps one chunk at a time and, before each, waits (`Pacer`) while the process's other threads
  have been computing (an engine step, a model load) — it maps while the engine is idle.
  A stop ends within one chunk.

What it costs and saves: BENCHMARKS.md ("Time to first token", "First request").
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tiers.region.file import PAGE, RegionLayout

__all__ = [
    "BUSY_SHARE",
    "PREFAULT_CHUNK",
    "Pacer",
    "Prefault",
    "cpu_clock",
    "shard_pages",
    "slot_ranges",
]

log = logging.getLogger("tiers.region")  # every line about the region under one logger

_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
PREFAULT_CHUNK = 4 << 20
"""Bytes mapped per call: 1-3 ms of the kernel's time here, the longest the background part
competes with an engine step that starts meanwhile (and the longest a stop waits)."""
BUSY_SHARE = 0.2
"""The background part waits while the process's other threads used more than this many CPU
seconds per second since its last look (an idle engine uses ~0; a step, every core it has)."""
PAUSE = 0.01
"""Seconds between two looks while the engine is busy."""

Clock = Callable[[], tuple[float, float, float]]
"""(the process's CPU seconds, the calling thread's CPU seconds, wall seconds)."""


def cpu_clock() -> tuple[float, float, float]:
    return time.process_time(), time.thread_time(), time.monotonic()


class Pacer:
    """The background part's yield: `wait` returns once the process's other threads have been
    (nearly) idle since the last look, or `stop` is set. Made and used on one thread (its
    own CPU time is left out of the process's)."""

    def __init__(self, clock: Clock = cpu_clock, share: float = BUSY_SHARE, pause: float = PAUSE):
        self.clock, self.share, self.pause = clock, share, pause
        self.paused = 0.0
        """Seconds spent waiting for the engine."""
        self._last = clock()

    def busy(self) -> bool:
        """Whether the other threads used more than `share` of a core since the last look."""
        process, thread, wall = now = self.clock()
        before_process, before_thread, before_wall = self._last
        self._last = now
        others = (process - before_process) - (thread - before_thread)
        return others > self.share * max(wall - before_wall, 1e-6)

    def wait(self, stop: threading.Event) -> None:
        while self.busy():
            began = time.monotonic()
            if stop.wait(self.pause):
                return
            self.paused += time.monotonic() - began


class Prefault:
    """The prefault of one process's mapping of a region: its first slots on the caller's
    thread, the rest on a background thread that yields to the engine; `stop` joins it (within
    one chunk)."""

    def __init__(self, pacer: Callable[[], Pacer] = Pacer) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pacer = pacer

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(
        self, base: int, layout: RegionLayout, rank: int | None, what: object, sync_slots: int = 0
    ) -> bool:
        """Map the pages of the slots at address `base` writable, slot 0 first: the first
        `sync_slots` before returning, the others in the background; with `rank`, only that
        worker's shard of each slot. `what` names the region in log lines.

        Returns False (nothing started) where the kernel lacks MADV_POPULATE_WRITE."""
        madvise = _madvise()
        if madvise is None:
            return False
        sync_slots = max(0, min(sync_slots, layout.num_slots))
        now = slot_ranges(base, layout, rank, 0, sync_slots)
        later = slot_ranges(base, layout, rank, sync_slots, layout.num_slots)
        began = time.perf_counter()
        first = next(now, None) or next(later, None)
        if first is None or madvise(first[0], first[1], _MADV_POPULATE_WRITE) != 0:
            log.debug("primary region %s: MADV_POPULATE_WRITE unavailable", what)
            return False
        for address, length in now:  # the GIL is released while the kernel maps
            if madvise(address, length, _MADV_POPULATE_WRITE) != 0:
                break
        log.info(
            "primary region %s: %d of %d slots mapped before serving (%.3f s), the rest in the "
            "background while the engine is idle",
            what,
            sync_slots,
            layout.num_slots,
            time.perf_counter() - began,
        )
        stop = self._stop

        def run() -> None:
            with contextlib.suppress(OSError):  # the engine's threads come first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            pacer = self._pacer()
            began = time.perf_counter()
            for address, length in later:
                pacer.wait(stop)
                if stop.is_set() or madvise(address, length, _MADV_POPULATE_WRITE) != 0:
                    return
            log.debug(
                "primary region %s: mapped in the background in %.2f s, %.2f s of it waiting "
                "for the engine",
                what,
                time.perf_counter() - began,
                pacer.paused,
            )

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


def slot_ranges(
    base: int, layout: RegionLayout, rank: int | None, first: int, end: int
) -> Iterator[tuple[int, int]]:
    """(address, length) of the pages of slots `first` to `end` (excluded) that this process
    maps: all of each slot, or with `rank` that worker's shard of each; in chunks of at most
    `PREFAULT_CHUNK`, listed as they are taken."""
    if rank is not None and layout.num_workers > 1:
        return shard_pages(base, layout, rank, first, end)
    low, high = base + first * layout.slot_stride, base + end * layout.slot_stride
    return ((at, min(PREFAULT_CHUNK, high - at)) for at in range(low, high, PREFAULT_CHUNK))


def shard_pages(
    base: int, layout: RegionLayout, rank: int, first: int = 0, end: int | None = None
) -> Iterator[tuple[int, int]]:
    """(address, length) of the pages holding worker `rank`'s shard of slots `first` to `end`
    (default: every slot), merged where consecutive slots' ranges touch, in chunks of at most
    `PREFAULT_CHUNK`."""
    start = rank * layout.shard_bytes
    run_start = run_end = -1
    for slot in range(first, layout.num_slots if end is None else end):
        at = base + slot * layout.slot_stride + start
        low = at - at % PAGE
        high = at + layout.shard_bytes
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
