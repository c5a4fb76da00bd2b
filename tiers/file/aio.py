"""Linux native asynchronous I/O (`io_submit`) for O_DIRECT reads and writes made from the event
loop: a batch of blocks goes to the disk in one system call and the completions come back
through an eventfd the loop watches, with no thread in between. A call through the tier's
thread pool crosses to a worker and back, a cost of the order of the transfer itself, and a
batch waits for each of its workers to wake (BENCHMARKS.md, "Secondary tiers against raw
baselines").

The segment layout of the file tier uses it where it can: Linux on x86-64 or arm64, O_DIRECT,
page-aligned writable buffers. Every request carries `RWF_NOWAIT`: one that would block in its
submission (a file system lock, an extent map not in memory, a full ring) completes with
EAGAIN instead and the caller redoes it in its thread pool, so the loop never waits for the
disk. A file system that refuses `RWF_NOWAIT` answers EOPNOTSUPP, which also means "redo in
threads" (and the caller stops trying). Buffers are pinned (a ctypes view holds their export)
from submission to completion, and `wait` returns only once every request has completed, even
when its caller is cancelled: the kernel writes into the caller's buffers until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import platform
import sys
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["PREADV", "PWRITEV", "REDO", "KernelAio"]

PREADV = 7  # IOCB_CMD_PREADV
PWRITEV = 8  # IOCB_CMD_PWRITEV
_FLAG_RESFD = 1  # IOCB_FLAG_RESFD: signal the eventfd in aio_resfd on completion
_RWF_NOWAIT = 0x8
REDO = frozenset({errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL})
"""Negative results that mean "not done: redo it in threads" (the threads' answer is the one
that counts, an EINVAL from a misaligned request included)."""

# io_setup, io_destroy, io_submit, io_getevents
_SYSCALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}


class _Iocb(ctypes.Structure):
    """Any thread (a value): the kernel's `struct iocb`, one request."""

    _fields_ = [  # struct iocb, little-endian
        ("data", ctypes.c_uint64),
        ("key", ctypes.c_uint32),
        ("rw_flags", ctypes.c_int32),
        ("opcode", ctypes.c_uint16),
        ("reqprio", ctypes.c_int16),
        ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    """Any thread (a value): the kernel's `struct io_event`, one completion."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class _Iovec(ctypes.Structure):
    """Any thread (a value): `struct iovec`, one buffer of a request."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Timespec(ctypes.Structure):
    """Any thread (a value): `struct timespec`, the zero wait of a reap."""

    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


Request = tuple[int, int, Sequence[memoryview], int]
"""(PREADV or PWRITEV, file descriptor, writable C-contiguous buffers, file offset)."""


class KernelAio:
    """Runtime thread (one event loop at a time, which gets the completions): a kernel AIO
    context with room for `depth` requests. Raises OSError where the kernel or platform has
    none."""

    def __init__(self, depth: int = 256) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if not sys.platform.startswith("linux") or numbers is None:
            raise OSError(
                errno.ENOSYS, f"no kernel AIO here ({sys.platform}, {platform.machine()})"
            )
        self._setup, self._destroy, self._submit, self._getevents = numbers
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._ctx = ctypes.c_ulong(0)
        if self._syscall(ctypes.c_long(self._setup), ctypes.c_long(depth), ctypes.byref(self._ctx)):
            code = ctypes.get_errno()
            raise OSError(code, f"io_setup: {os.strerror(code)}")
        try:
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            self._syscall(ctypes.c_long(self._destroy), self._ctx)
            raise
        self.depth = depth
        self._events = (_Event * depth)()
        self._now = _Timespec(0, 0)
        self._pending: dict[int, tuple[asyncio.Future[int], Any]] = {}
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()
        self._closed = False
        # A context never closed (its tier was dropped unclosed) would hold its share of the
        # system's aio-max-nr until the process exits: released when collected instead.
        self._release = weakref.finalize(
            self, _release, self._syscall, self._destroy, self._ctx.value, self._efd, self._pid
        )

    def bind(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether requests can be made from `loop` now: completions go to one loop, so a new
        loop takes over only when nothing is in flight (never in a forked child)."""
        if self._loop is loop:
            return True
        if self._closed or self._pending or self._pid != os.getpid():
            return False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        loop.add_reader(self._efd, self._reap)
        self._loop = loop
        return True

    def submit(self, requests: Sequence[Request]) -> list[asyncio.Future[int]]:
        """Start `requests` (one system call for all that the ring takes); each future's result
        is the bytes moved or a negative errno (`-EAGAIN` where the request was not started)."""
        loop = self._loop
        assert loop is not None, "bind the context to a loop first"
        blocks = (ctypes.POINTER(_Iocb) * len(requests))()
        entries = []
        for k, (op, fd, views, offset) in enumerate(requests):
            vectors = (_Iovec * len(views))()
            pinned = []
            for i, view in enumerate(views):
                memory = (ctypes.c_char * len(view)).from_buffer(view)  # holds the export
                pinned.append(memory)
                vectors[i].base = ctypes.addressof(memory)
                vectors[i].len = len(view)
            block = _Iocb()
            block.opcode = op
            block.rw_flags = _RWF_NOWAIT
            block.fildes = fd
            block.buf = ctypes.addressof(vectors)
            block.nbytes = len(views)
            block.offset = offset
            block.flags = _FLAG_RESFD
            block.resfd = self._efd
            blocks[k] = ctypes.pointer(block)
            entries.append((block, vectors, pinned))
        futures: list[asyncio.Future[int]] = []
        for block, vectors, pinned in entries:  # all built: nothing can fail half-registered
            self._next += 1
            block.data = self._next
            future = loop.create_future()
            self._pending[self._next] = (future, (block, vectors, pinned))
            futures.append(future)
        started = 0
        while started < len(requests):
            n = self._syscall(
                ctypes.c_long(self._submit),
                self._ctx,
                ctypes.c_long(len(requests) - started),
                ctypes.byref(blocks, started * ctypes.sizeof(ctypes.c_void_p)),
            )
            if n <= 0:
                code = ctypes.get_errno() if n < 0 else errno.EAGAIN
                for k in range(started, len(requests)):  # not started: answered at once
                    self._pending.pop(blocks[k].contents.data, None)
                    futures[k].set_result(-code)
                break
            started += n
        return futures

    async def wait(self, futures: Sequence[asyncio.Future[int]]) -> list[int]:
        """The results of `futures`, once all have completed, even if the caller is cancelled
        meanwhile (the cancellation is raised after)."""
        pending = [f for f in futures if not f.done()]
        if pending:
            waiter = pending[0].get_loop().create_future()
            left = len(pending)

            def one_done(_: asyncio.Future[int]) -> None:
                nonlocal left
                left -= 1
                if not left and not waiter.done():
                    waiter.set_result(None)

            for future in pending:
                future.add_done_callback(one_done)
            try:
                await waiter  # cheaper than asyncio.wait: no sets, no callbacks to remove
            except asyncio.CancelledError:
                while not all(f.done() for f in futures):
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait(futures)
                raise
        return [f.result() for f in futures]

    def _reap(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            return
        events = self._events
        while self._pending:
            n = self._syscall(
                ctypes.c_long(self._getevents),
                self._ctx,
                ctypes.c_long(0),
                ctypes.c_long(len(events)),
                events,
                ctypes.byref(self._now),
            )
            if n < 0 and ctypes.get_errno() == errno.EINTR:
                continue  # the eventfd is read: what completed must be reaped now
            if n <= 0:
                return
            for i in range(n):
                entry = self._pending.pop(events[i].data, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(events[i].res)
            if n < len(events):
                return

    def close(self) -> None:
        """Wait for the requests in flight (io_destroy does) and release the context."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        self._release.detach()
        self._syscall(ctypes.c_long(self._destroy), self._ctx)
        for future, _ in self._pending.values():
            if not future.done() and not future.get_loop().is_closed():
                future.set_result(-errno.ECANCELED)
        self._pending.clear()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        os.close(self._efd)


def _release(syscall: Any, destroy: int, ctx: int, efd: int, pid: int) -> None:
    """io_destroy (which waits for requests in flight) and the eventfd, for a context dropped
    without `close`; nothing in a forked child (the context is the parent's)."""
    if os.getpid() != pid:
        return
    syscall(ctypes.c_long(destroy), ctypes.c_ulong(ctx))
    os.close(efd)
