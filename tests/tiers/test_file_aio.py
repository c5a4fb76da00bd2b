"""Kernel AIO (`tiers/file/aio.py`) and the segment layout's use of it: requests made from the event
loop, results as values, buffers held until the kernel is done, and everything it cannot do
redone in the pool's threads."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from tiering.errors import TierFull, TierTimeout, TierUnavailable
from tiering.testing import NAMESPACE, key, payload
from tiers.file import SegmentFileTier
from tiers.file.aio import PREADV, PWRITEV, REDO, KernelAio
from tiers.file.direct import direct_supported

SIZE = 64 << 10


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """A directory on a disk file system (kernel AIO is for O_DIRECT files; on tmpfs the tier
    would use buffered I/O and these tests would test nothing): said, not skipped."""
    assert direct_supported(tmp_path), f"{tmp_path} does not support O_DIRECT (tmpfs?)"
    return tmp_path


def slot(fill: bytes | None = None, size: int = SIZE) -> memoryview:
    """A page-aligned writable buffer, as a primary slot is."""
    view = memoryview(mmap.mmap(-1, size))
    if fill is not None:
        view[:] = fill
    return view


def segments(path: Path, **options: Any) -> SegmentFileTier:
    return SegmentFileTier(namespace=NAMESPACE, path=path, min_free=0, **options)


def test_kernel_aio_writes_and_reads_from_the_loop(direct_dir: Path) -> None:
    fd = os.open(direct_dir / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, 4 * SIZE)  # as segment files are: writes that extend a file
    # would block on its metadata, and RWF_NOWAIT answers them EAGAIN

    async def body() -> None:
        aio = KernelAio(8)
        assert aio.bind(asyncio.get_running_loop())
        blocks = [slot(payload(SIZE, i)) for i in range(3)]
        requests = [(PWRITEV, fd, [b], i * SIZE) for i, b in enumerate(blocks[:2])]
        requests.append((PWRITEV, fd, [blocks[2]], 2 * SIZE))
        assert await aio.wait(aio.submit(requests)) == [SIZE] * 3  # one system call, three
        back = [slot() for _ in range(2)]
        got = await aio.wait(aio.submit([(PREADV, fd, back, SIZE)]))  # two vectors, one request
        assert got == [2 * SIZE]
        assert bytes(back[0]) == payload(SIZE, 1) and bytes(back[1]) == payload(SIZE, 2)
        aio.close()

    try:
        asyncio.run(body())
    finally:
        os.close(fd)


def test_kernel_aio_failures_are_results_not_exceptions(direct_dir: Path) -> None:
    with open(direct_dir / "f", "wb") as f:
        f.write(payload(2 * SIZE, 1))
    reader = os.open(direct_dir / "f", os.O_RDONLY | os.O_DIRECT)

    async def body() -> None:
        aio = KernelAio(8)
        assert aio.bind(asyncio.get_running_loop())
        write_to_reader = (PWRITEV, reader, [slot(payload(SIZE, 1))], 0)
        misaligned = (PREADV, reader, [slot(size=2 * SIZE)[100 : 100 + SIZE]], 0)
        results = await aio.wait(aio.submit([write_to_reader]))
        assert results == [-errno.EBADF]
        (result,) = await aio.wait(aio.submit([misaligned]))
        assert result < 0 and -result in REDO  # EINVAL, or EAGAIN before it: the pool decides
        aio.close()

    try:
        asyncio.run(body())
    finally:
        os.close(reader)


def test_kernel_aio_wait_outlives_its_cancellation(direct_dir: Path) -> None:
    """The kernel writes into the caller's buffer until the request completes: a cancelled
    caller must not get its buffer back before that."""
    fd = os.open(direct_dir / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.pwritev(fd, [slot(payload(8 * SIZE, 3), size=8 * SIZE)], 0)

    async def body() -> None:
        aio = KernelAio(8)
        assert aio.bind(asyncio.get_running_loop())
        futures = aio.submit([(PREADV, fd, [slot(size=8 * SIZE)], 0)])
        waiting = asyncio.ensure_future(aio.wait(futures))
        await asyncio.sleep(0)  # it waits now
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert all(f.done() for f in futures)
        assert futures[0].result() == 8 * SIZE
        aio.close()

    try:
        asyncio.run(body())
    finally:
        os.close(fd)


def test_kernel_aio_serves_one_loop_at_a_time(direct_dir: Path) -> None:
    """Completions go to one loop: a second loop takes the context over once nothing is in
    flight (tests and tools run a tier under several loops in turn)."""

    async def first(tier: SegmentFileTier) -> None:
        await tier.put(key(1), slot(payload(SIZE, 1)))
        await tier.put(key(2), slot(payload(SIZE, 2)))  # the file is open now: kernel AIO

    async def second(tier: SegmentFileTier) -> None:
        out = slot()
        assert await tier.get(key(2), out) and bytes(out) == payload(SIZE, 2)
        await tier.close()

    tier = segments(direct_dir, direct=True)
    asyncio.run(first(tier))
    assert tier._aio.context is not None
    asyncio.run(second(tier))


def _answer(monkeypatch: pytest.MonkeyPatch, code: int, seen: list[int]) -> None:
    """Every kernel AIO request answers `-code` without reaching the disk."""

    def submit(self: KernelAio, requests: Any) -> list[asyncio.Future[int]]:
        loop = asyncio.get_running_loop()
        seen.append(len(requests))
        futures = [loop.create_future() for _ in requests]
        for future in futures:
            future.set_result(-code)
        return futures

    monkeypatch.setattr(KernelAio, "submit", submit)


def test_segments_redo_in_threads_what_the_kernel_would_block_on(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        async with segments(direct_dir, direct=True) as tier:
            await tier.put(key(0), slot(payload(SIZE, 0)))  # opens the segment file
            seen: list[int] = []
            _answer(monkeypatch, errno.EAGAIN, seen)
            await tier.put(key(1), slot(payload(SIZE, 1)))
            assert await tier.put_many([(key(i), slot(payload(SIZE, i))) for i in (2, 3)]) == [
                None,
                None,
            ]
            out = [slot() for _ in range(4)]
            assert await tier.get(key(1), out[1])
            assert await tier.get_many([(key(i), out[i]) for i in (2, 3)]) == [True, True]
            assert [bytes(out[i]) for i in (1, 2, 3)] == [payload(SIZE, i) for i in (1, 2, 3)]
            assert len(seen) == 4 and not tier._aio.off  # asked each time, still on

            _answer(monkeypatch, errno.EOPNOTSUPP, seen)  # the file system cannot: stop asking
            assert await tier.get(key(3), out[0]) and bytes(out[0]) == payload(SIZE, 3)
            assert tier._aio.off and len(seen) == 5
            assert await tier.get(key(2), out[0]) and len(seen) == 5

    asyncio.run(body())


def test_segments_kernel_aio_failures_are_tier_errors(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error is `TierUnavailable` (the manager's miss), a full disk `TierFull`; the
    tier works again once the disk does."""

    async def body() -> None:
        async with segments(direct_dir, direct=True) as tier:
            await tier.put(key(0), slot(payload(SIZE, 0)))
            real = KernelAio.submit
            seen: list[int] = []
            _answer(monkeypatch, errno.EIO, seen)
            with pytest.raises(TierUnavailable, match="cannot read"):
                await tier.get(key(0), slot())
            with pytest.raises(TierUnavailable, match="cannot write"):
                await tier.put(key(1), slot(payload(SIZE, 1)))
            results = await tier.get_many([(key(0), slot()), (key(0), slot())])
            assert all(isinstance(r, TierUnavailable) for r in results)
            _answer(monkeypatch, errno.ENOSPC, seen)
            with pytest.raises(TierFull):
                await tier.put(key(1), slot(payload(SIZE, 1)))
            assert not tier.knows(key(1))
            monkeypatch.setattr(KernelAio, "submit", real)
            await tier.put(key(1), slot(payload(SIZE, 1)))
            out = slot()
            assert await tier.get(key(1), out) and bytes(out) == payload(SIZE, 1)

    asyncio.run(body())


def test_segments_kernel_aio_batches_keep_their_deadline(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose requests complete late fails with `TierTimeout` per block, and returns
    only once they have completed (the buffers are the caller's again)."""

    async def body() -> None:
        async with segments(direct_dir, direct=True) as tier:
            await tier.put(key(0), slot(payload(SIZE, 0)))
            await tier.put(key(1), slot(payload(SIZE, 1)))
            tier.timeout = 0.05  # only now: the puts above must not meet it on a busy machine
            real = KernelAio.wait
            pending: list[asyncio.Future[int]] = []

            async def slow(self: KernelAio, futures: Any) -> list[int]:
                pending.extend(futures)
                try:
                    await asyncio.sleep(0.2)  # the deadline passes meanwhile
                finally:
                    results = await real(self, futures)
                return results

            monkeypatch.setattr(KernelAio, "wait", slow)
            results = await tier.get_many([(key(0), slot()), (key(1), slot())])
            assert all(isinstance(r, TierTimeout) for r in results)
            assert pending and all(f.done() for f in pending)

    asyncio.run(body())


def test_a_kernel_aio_context_dropped_unclosed_is_released() -> None:
    """A context holds its depth of the system's `fs.aio-max-nr` (256 of the tier's 256-deep
    contexts fit in the default 65,536): one whose tier was dropped without `close` gives it
    back when it is collected, so a long-lived process that makes tiers keeps getting them."""
    limit = int(Path("/proc/sys/fs/aio-max-nr").read_text())
    for _ in range(limit // 4096 + 10):  # more than fit at once (each counts its depth)
        KernelAio(4096)
