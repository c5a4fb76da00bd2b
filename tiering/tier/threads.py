"""A bounded pool of threads for blocking tier I/O, cheaper per call than `run_in_executor`.

`loop.run_in_executor(ThreadPoolExecutor)` pays per call for a `concurrent.futures.Future`, its
chaining to an asyncio future, and the executor's queue and lock; a `SimpleQueue` to the workers
and one `call_soon_threadsafe` back costs about half as much, a cost that matters beside a
256 KiB read from NVMe (BENCHMARKS.md, "Secondary tiers against raw baselines", tier threads).
Calls that end while the loop has
not yet run the previous ones' results are handed over with them, in one wake-up.

Workers start when calls need them (up to `count`), again in a forked child (a fork keeps no
threads), and stop at `shutdown`, after the calls already queued; a worker still blocked in a
call after `shutdown`'s `wait` is left behind (a daemon: it ends with its call, or with the
process), so a store that never answers cannot hold a close.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["IOThreads"]

T = TypeVar("T")
_STOP = None


class IOThreads:
    """Runtime thread (the event loop) submits, `count` worker threads run: `await
    threads.run(function, *args)` runs `function(*args)` on one of them."""

    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ValueError(f"thread count must be at least 1, not {count}")
        self.count = count
        self.name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # threads waiting for a call
        self._pid = 0
        self._closed = False
        self._watched: dict[asyncio.Future[Any], asyncio.Future[None] | None] = {}
        # Calls ended and not yet settled, per loop; a loop is in here when a drain is due.
        self._ended_lock = threading.Lock()
        self._ended: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, Any]]] = {}

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        return await self.submit(function, *args)

    async def run_to_end(self, function: Callable[..., T], *args: Any) -> T:
        """Like `run`, but a cancelled caller returns only once the call has ended (it may be
        using the caller's buffers: a primary slot handed to another block meanwhile would be
        overwritten); cheaper than `asyncio.shield` (no second future). Further cancellations
        while it waits (a second deadline around the first) are absorbed: the caller's
        cancellation is raised once the call has ended."""
        future = self.submit(function, *args)
        self._watched[future] = None
        try:
            return await future
        except asyncio.CancelledError:
            if future.cancelled() and future in self._watched:  # the call still runs
                waiter = future.get_loop().create_future()
                self._watched[future] = waiter
                while not waiter.done():
                    try:
                        await asyncio.wait([waiter])
                    except asyncio.CancelledError:
                        continue  # cancelled again: the thread still holds the buffers
            raise
        finally:
            self._watched.pop(future, None)

    def submit(self, function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """The future of `function(*args)` on the running loop. Cancelling it does not stop
        the call (`run_to_end` waits for it, when the call uses the caller's buffers)."""
        if self._closed:
            raise RuntimeError(f"thread pool {self.name!r} is shut down")
        loop = asyncio.get_running_loop()  # RuntimeError outside a loop: nothing started
        if self._pid != os.getpid():
            self._lock = threading.Lock()  # a parent's thread may have held it at the fork
            self._reset()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, function, args))
        if not self._idle.acquire(blocking=False) and len(self._threads) < self.count:
            self._add_thread()  # as many threads as calls at once, up to `count`
        return future

    def shutdown(self, wait: float | None = None) -> int:
        """Stop the workers once the calls already queued have run; waits for them, for at
        most `wait` seconds in all (None: for as long as they take). The workers still running
        then, left behind."""
        with self._lock:
            self._closed = True
            threads = self._threads if self._pid == os.getpid() else []
            self._threads = []
        for _ in threads:
            self._queue.put(_STOP)
        end = None if wait is None else time.monotonic() + wait
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return sum(thread.is_alive() for thread in threads)

    def _reset(self) -> None:
        """A fresh pool in this process (the first call, or the first in a forked child)."""
        with self._lock:
            if self._pid == os.getpid():
                return
            self._queue = queue.SimpleQueue()  # a parent's queue may hold its calls
            self._ended_lock = threading.Lock()
            self._ended = {}
            self._idle = threading.Semaphore(0)
            self._threads = []
            self._pid = os.getpid()

    def _add_thread(self) -> None:
        """Threads start on demand, not all at the first call: on a busy host starting a
        dozen threads at once made the first promotion of a restarted engine miss its
        deadline (seen in `kvtier demo`'s warm restart)."""
        with self._lock:
            if self._closed or len(self._threads) >= self.count:
                return
            thread = threading.Thread(
                target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        get = self._queue.get
        while (item := get()) is not _STOP:
            loop, future, function, args = item
            result, error = None, None
            try:
                result = function(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                error = e
            self._idle.release()  # free for the next call, before its caller can learn it
            with self._ended_lock:  # one wake-up of the loop for the calls that end meanwhile
                ended = self._ended.get(loop)
                if ended is not None:
                    ended.append((future, result, error))
                else:
                    self._ended[loop] = [(future, result, error)]
            if ended is None:
                try:
                    loop.call_soon_threadsafe(self._settle, loop)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    with self._ended_lock:
                        self._ended.pop(loop, None)
            del item, loop, future, function, args, result, error, ended

    def _settle(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._ended_lock:
            ended = self._ended.pop(loop, ())
        for future, result, error in ended:
            if future.cancelled():
                waiter = self._watched.pop(future, None)  # popped: the call has ended
                if waiter is not None:
                    waiter.set_result(None)
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
