"""The tier I/O thread pool: results and errors reach the caller, a cancelled `run_to_end`
returns only once its call has ended, a forked child gets workers of its own, and shutdown runs
what was queued."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from tiering.tier.threads import IOThreads


def test_results_and_errors_reach_the_caller() -> None:
    async def body() -> None:
        threads = IOThreads(2, "t")
        assert await threads.run(lambda a, b: a + b, 2, 3) == 5
        assert await threads.run(threading.current_thread) is not threading.current_thread()
        with pytest.raises(ZeroDivisionError):
            await threads.run(lambda: 1 / 0)
        got = await asyncio.gather(*(threads.run(time.sleep, 0.05) for _ in range(4)))
        assert got == [None] * 4
        threads.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await threads.run(int)

    asyncio.run(body())


def test_a_cancelled_run_to_end_returns_after_its_call() -> None:
    ended: list[float] = []

    def slow() -> None:
        time.sleep(0.2)
        ended.append(time.monotonic())

    async def body() -> None:
        threads = IOThreads(1, "t")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await threads.run_to_end(slow)
        assert ended and ended[0] <= time.monotonic()  # the call was over before we got here
        assert not threads._watched
        # a plain `run` does not wait: it returns at once and the call goes on
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await threads.run(slow)
        assert len(ended) == 1
        threads.shutdown()  # runs what is queued, then stops
        assert len(ended) == 2

    asyncio.run(body())


def test_run_to_end_waits_through_a_second_deadline() -> None:
    """Two deadlines, one inside the other (a job's and a tier call's): the second
    cancellation arrives while run_to_end waits for the thread, which still writes into the
    caller's buffer (a primary slot the manager would hand to another block at once)."""
    buffer = bytearray(4)

    def slow_read() -> None:
        time.sleep(0.3)
        buffer[:] = b"late"

    async def body() -> None:
        threads = IOThreads(1, "t")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):  # the job's deadline
                async with asyncio.timeout(0.1):  # the tier call's, which comes later
                    await threads.run_to_end(slow_read)
        assert time.monotonic() - start >= 0.29
        assert buffer == b"late"  # written before the caller learnt of its timeout
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # no stray cancellation left
        threads.shutdown()

    asyncio.run(body())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_starts_its_own_workers() -> None:
    threads = IOThreads(1, "t")
    assert asyncio.run(threads.run(os.getpid)) == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker is not here
        try:
            ok = asyncio.run(asyncio.wait_for(threads.run(os.getpid), 5)) == os.getpid()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    threads.shutdown()


def test_outside_a_loop_nothing_starts() -> None:
    threads = IOThreads(2, "t")
    with pytest.raises(RuntimeError, match="no running event loop"):
        threads.submit(int)
    assert not threads._threads


def test_threads_start_as_calls_need_them() -> None:
    """Not all at the first call: starting a dozen threads at once on a busy host made a
    restarted engine's first promotion miss its deadline."""

    async def body() -> None:
        threads = IOThreads(8, "t")
        for _ in range(5):
            await threads.run(int)
        assert len(threads._threads) == 1  # one call at a time: one thread, reused
        await asyncio.gather(*(threads.run(time.sleep, 0.05) for _ in range(3)))
        assert 2 <= len(threads._threads) <= 3
        await asyncio.gather(*(threads.run(time.sleep, 0.02) for _ in range(20)))
        assert len(threads._threads) == 8  # never more than asked for
        threads.shutdown()
        assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("t-"))

    asyncio.run(body())
