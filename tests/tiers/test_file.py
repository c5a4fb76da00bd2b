"""The file tier against the conformance suite (with and without O_DIRECT), plus restarts,
crashed writes and a full disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tiering.errors import CorruptObject, TierFull
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE, key, payload
from tiering.testing.tier import MakeTier, StoreDown, TierConformance
from tiering.tier import Tier
from tiers.file import BlockFileTier, FileTier, SegmentFileTier
from tiers.file.files import TMP_MAX_AGE


@contextlib.contextmanager
def directory_gone(path: Path) -> Iterator[None]:
    """The tier's directory moved away and a plain file in its place (root ignores file modes,
    so a chmod would not keep it out): every path under it fails with ENOTDIR."""
    away = path.with_name(path.name + ".away")
    path.rename(away)
    path.write_bytes(b"not a directory")
    try:
        yield
    finally:
        path.unlink()
        away.rename(path)


class TestFileTier(TierConformance):
    """The `files` layout: a file per block."""

    @pytest.fixture(params=[True, False], ids=["direct", "buffered"])
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> MakeTier:
        def make(**options: Any) -> Tier:
            return BlockFileTier(
                path=tmp_path,
                min_free=0,
                direct=request.param,
                **{"namespace": NAMESPACE, **options},
            )

        return make

    @pytest.fixture
    def store_down(self, tmp_path: Path) -> StoreDown:
        return lambda tier: directory_gone(tmp_path)

    @staticmethod
    def path_of(tier: Tier, key: BlockKey) -> Path:
        """Where the object of `key` lives (its file may not exist)."""
        assert isinstance(tier, BlockFileTier)
        return tier._path(key)

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        path = self.path_of(tier, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        path = self.path_of(tier, key)
        return path.read_bytes() if path.exists() else None

    large_object_bytes = 64 << 30

    async def raw_put_large(self, tier: Tier, key: BlockKey, head: bytes, size: int) -> None:
        """A sparse file of `size` bytes (64 GiB) that starts with `head`."""
        path = self.path_of(tier, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(size)


class TestSegmentFileTier(TierConformance):
    """The `segments` layout: blocks appended to segment files."""

    one_writer = True

    @pytest.fixture(params=[True, False], ids=["direct", "buffered"])
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> MakeTier:
        def make(**options: Any) -> Tier:
            return SegmentFileTier(
                path=tmp_path,
                min_free=0,
                direct=request.param,
                segment_size="1MiB",
                **{"namespace": NAMESPACE, **options},
            )

        return make

    @pytest.fixture
    def store_down(self) -> StoreDown:
        pytest.skip(
            "segments: the tier holds its segment files open, and nothing in the file system "
            "takes an open file away from a process running as root"
        )

    @staticmethod
    def location(tier: Tier, key: BlockKey) -> tuple[Path, int, int] | None:
        """(segment file, offset, object length) of `key`'s copy, or None."""
        assert isinstance(tier, SegmentFileTier)
        place = tier._index.get(key)
        return None if place is None else (place.segment.path, place.offset, place.length)

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        assert isinstance(tier, SegmentFileTier)
        read_only = tier.read_only
        tier.read_only = tier._files.read_only = False  # (a read-only tier opens files so)
        try:
            await tier._write(key, [blob])  # the bytes as they are: no header made, none checked
        finally:
            tier.read_only = tier._files.read_only = read_only

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        where = self.location(tier, key)
        if where is None:
            return None
        path, offset, length = where
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)


path_of = TestFileTier.path_of
location = TestSegmentFileTier.location


def test_direct_io_is_used_where_supported(tmp_path: Path) -> None:
    tier = BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0)
    assert tier.direct  # ext4 here; tmpfs would say no
    asyncio.run(tier.close())


def test_restart_keeps_complete_blocks_and_drops_half_written_ones(tmp_path: Path) -> None:
    async def body() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0) as tier:
            for i in range(5):
                await tier.put(key(i), payload(50_000, i))
            path = path_of(tier, key(2))
        # A crash mid-write leaves a temporary file, removed once it is older than any write
        # takes (a fresh one may be another process's write in flight, whatever its pid); a
        # torn file under a real name (written by something else) must not be served either.
        abandoned = path.parent / f".{path.name}.999.0.tmp"
        abandoned.write_bytes(b"half")
        old = time.time() - TMP_MAX_AGE - 60
        os.utime(abandoned, (old, old))
        fresh = path.parent / f".{path.name}.999.1.tmp"
        fresh.write_bytes(b"being written")
        torn = path_of(tier, key(3))
        torn.write_bytes(torn.read_bytes()[:20_000])
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0) as again:
            assert (await again.stat()).objects == 4
            assert again.counters["corrupt.truncated"] == 1
            assert list(tmp_path.rglob("*.tmp")) == [fresh]
            for i in (0, 1, 2, 4):
                assert await again.get_bytes(key(i), 50_000) == payload(50_000, i)
            assert await again.get_bytes(key(3), 50_000) is None

    asyncio.run(body())


def test_restart_keeps_recency_order_for_eviction(tmp_path: Path) -> None:
    async def body() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0) as tier:
            for i in range(3):
                await tier.put(key(i), payload(100_000, i))
                os.utime(path_of(tier, key(i)), (1000 + i, 1000 + i))
        async with BlockFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=0, capacity=350_000
        ) as again:
            await again.put(key(9), payload(100_000, 9))
            assert await again.contains([key(0), key(1), key(2), key(9)]) == [
                False,
                True,
                True,
                True,
            ]

    asyncio.run(body())


def test_full_disk_fails_softly(tmp_path: Path) -> None:
    async def body() -> None:
        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        async with BlockFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=free + (1 << 30)
        ) as tier:
            with pytest.raises(TierFull, match="would leave less than min_free"):
                await tier.put(key(1), b"x" * 4096)
            assert await tier.contains([key(1)]) == [False]
            assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))
            assert await tier.get_bytes(key(1), 4096) is None  # still serves (misses)

    asyncio.run(body())


def test_namespaces_live_apart(tmp_path: Path) -> None:
    async def body() -> None:
        other = bytes(16)
        async with (
            BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0) as ours,
            BlockFileTier(namespace=other, path=tmp_path, min_free=0) as theirs,
        ):
            await ours.put(key(1), b"ours")
            assert await theirs.get_bytes(key(1), 4) is None
            assert [k async for k in theirs.keys()] == []

    asyncio.run(body())


def test_direct_io_moves_page_aligned_slots_without_bounce_buffers(tmp_path: Path) -> None:
    import mmap

    async def body() -> None:
        async with BlockFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=0, direct=True
        ) as tier:
            source = memoryview(mmap.mmap(-1, 64 << 10))
            source[:] = payload(64 << 10, 5)
            await tier.put(key(1), source)
            assert path_of(tier, key(1)).stat().st_size == 4096 + (64 << 10)
            target = memoryview(mmap.mmap(-1, 64 << 10))
            assert await tier.get(key(1), target)
            assert bytes(target) == payload(64 << 10, 5)
            wrong = memoryview(mmap.mmap(-1, 128 << 10))  # an aligned slot of another size
            assert await tier.get(key(1), wrong) is False
            assert tier.counters["corrupt.length"] == 1

    asyncio.run(body())


def test_a_timed_out_read_lets_go_of_the_buffer_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool thread reads straight into the caller's buffer (a primary slot): after a
    deadline the call must not return while that thread can still write there, or a slot
    handed to another block would be overwritten."""
    import time

    from tiering.errors import TierTimeout

    tier = BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0, timeout=0.05)
    asyncio.run(tier.put(key(1), payload(4096, 1)))
    read = tier._files.read_into

    def slow(path: Path, view: memoryview, limit: int) -> bytes | None:
        time.sleep(0.3)
        return read(path, view, limit)

    monkeypatch.setattr(tier._files, "read_into", slow)
    buffers = [bytearray(4096), bytearray(4096)]

    async def body() -> None:
        with pytest.raises(TierTimeout):
            await tier.get(key(1), buffers[0])
        outcome = await tier.get_many([(key(1), buffers[1]), (key(2), bytearray(4096))])
        assert all(isinstance(o, TierTimeout) for o in outcome)
        seen = [bytes(b) for b in buffers]
        await asyncio.sleep(0.5)
        assert [bytes(b) for b in buffers] == seen  # nothing wrote into them after the return
        await tier.close()

    asyncio.run(body())


# -- the segment layout -----------------------------------------------------------------------


def segments(path: Path, **options: Any) -> SegmentFileTier:
    options.setdefault("min_free", 0)
    return SegmentFileTier(namespace=NAMESPACE, path=path, **options)


def test_segments_append_blocks_to_few_files(tmp_path: Path) -> None:
    async def body() -> None:
        async with segments(tmp_path, segment_size="1MiB") as tier:
            await tier.put_many([(key(i), payload(60_000, i)) for i in range(40)])
            files = sorted(tmp_path.rglob("*.kvs"))
            assert len(files) == 3  # 16 objects of 64 KiB (4 KiB header, padded) per 1 MiB
            assert not list(tmp_path.rglob("*.kv"))
            assert [location(tier, key(i))[1] for i in range(3)] == [0, 65536, 131072]  # type: ignore[index]

    asyncio.run(body())


def test_segments_restart_keeps_blocks_skips_holes_and_drops_torn_ones(tmp_path: Path) -> None:
    async def body() -> None:
        async with segments(tmp_path, segment_size="256KiB") as tier:
            for i in range(8):  # two objects of 64 KiB + 4 KiB... per segment
                await tier.put(key(i), payload(100_000, i))
            await tier.put(key(1), payload(100_000, 11))  # overwritten: the later copy wins
            assert await tier.delete(key(4))  # deleted: a tombstone keeps it deleted
            hole = location(tier, key(2))
            torn = location(tier, key(7))  # in the newest segments: payloads are verified
            last = location(tier, key(1))
        assert hole and torn and last
        with open(hole[0], "r+b") as f:  # a crash left a hole where an object was going
            f.seek(hole[1])
            f.write(bytes(hole[2]))
        with open(torn[0], "r+b") as f:  # a write cut short in its payload
            f.seek(torn[1] + 50_000)
            f.write(b"\xff" * 100)
        async with segments(tmp_path, segment_size="256KiB") as again:
            wanted = {0: 0, 1: 11, 3: 3, 5: 5, 6: 6}
            for i, seed in wanted.items():
                assert await again.get_bytes(key(i), 100_000) == payload(100_000, seed), i
            for i in (2, 4, 7):
                assert await again.get_bytes(key(i), 100_000) is None, i
            assert (await again.stat()).objects == 5
            assert again.counters["corrupt.checksum"] == 1

    asyncio.run(body())


def test_the_start_logs_what_it_does_with_a_damaged_object(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged object found at start by a writable tier: the files layout removes it; the
    segment layout keeps the record as dead space beside a live one (it said "removing"), and
    removes it with its segment when nothing else in it is live. The log says which."""

    def damage(path: Path, at: int) -> None:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(b"\xff" * 8)

    async def restart(make: Callable[[], Tier]) -> str:
        caplog.clear()
        async with make() as tier:
            assert len(tier.damaged) == 1
            logged = caplog.text
        assert logged.count("a damaged object at start") == 1, logged
        return logged

    async def body() -> None:
        async with segments(tmp_path / "kept") as tier:
            await tier.put(key(1), payload(8192, 1))
            await tier.put(key(2), payload(8192, 2))
            kept = location(tier, key(1))
        async with segments(tmp_path / "dropped") as tier:
            await tier.put(key(1), payload(8192, 1))
            dropped = location(tier, key(1))
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path / "f", min_free=0) as tier:
            await tier.put(key(1), payload(8192, 1))
            path = path_of(tier, key(1))
        assert kept and dropped
        damage(kept[0], kept[1] + 5000)
        damage(dropped[0], dropped[1] + 5000)
        damage(path, 0)  # its header: the files layout checks headers at start
        before = kept[0].read_bytes()

        assert "leaving a damaged object" in await restart(lambda: segments(tmp_path / "kept"))
        assert kept[0].read_bytes() == before
        logged = await restart(lambda: segments(tmp_path / "dropped"))
        assert "removing a damaged object" in logged
        assert not dropped[0].exists()
        logged = await restart(
            lambda: BlockFileTier(namespace=NAMESPACE, path=tmp_path / "f", min_free=0)
        )
        assert "removing a damaged object" in logged
        assert not path.exists()

    with caplog.at_level("WARNING", logger="tiers.file.base"):
        asyncio.run(body())


def test_segments_evict_the_least_recently_used_segment_whole(tmp_path: Path) -> None:
    async def body() -> None:
        async with segments(tmp_path, capacity=4 << 20) as tier:  # segments of 256 KiB
            assert tier.segment_size == 256 << 10
            for i in range(40):  # 100 KiB objects: two per segment
                await tier.put(key(i), payload(100_000, i))
                if i % 4 == 3:
                    assert await tier.get_bytes(key(0), 100_000) is not None  # keep it used
            stat = await tier.stat()
            assert stat.bytes_used <= 4 << 20
            present = await tier.contains([key(i) for i in range(40)])
            assert present[0] and present[1]  # segment-mate of a block in use
            assert not present[2] and present[39]
            assert tier.counters["evictions"] == 40 - stat.objects
            on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kvs"))
            assert on_disk <= 4 << 20  # evicted segments' files are gone

    asyncio.run(body())


def test_segments_emptied_by_deletes_are_removed(tmp_path: Path) -> None:
    async def body() -> None:
        async with segments(tmp_path, segment_size="128KiB") as tier:
            for i in range(6):  # one 100 KiB object per segment
                await tier.put(key(i), payload(100_000, i))
            assert len(list(tmp_path.rglob("*.kvs"))) == 6
            for i in range(5):
                await tier.delete(key(i))
            await asyncio.sleep(0.05)  # files go on the pool once no call uses them
            (left,) = tmp_path.rglob("*.kvs")  # the active one stays
            used = (await tier.stat()).bytes_used
            assert used == left.stat().st_size  # what it takes on disk: all of it preallocated
            assert used == (128 << 10 if tier._ledger.preallocating else 104 << 10)
        assert left.stat().st_size == 104 << 10  # trimmed to its objects on close

    asyncio.run(body())


def test_segments_preallocated_tail_is_skipped_at_restart(tmp_path: Path) -> None:
    """A new segment file is preallocated (appending O_DIRECT writes serialize on the file's
    metadata); after a crash its zero tail is not trimmed, and a restart skips it and any hole
    quickly, finding every block written, including one past a hole."""

    async def body() -> None:
        tier = segments(tmp_path, segment_size="4MiB")
        for i in range(3):
            await tier.put(key(i), payload(100_000, i))
        (path,) = tmp_path.rglob("*.kvs")
        assert path.stat().st_size == 4 << 20  # preallocated (tmp_path supports it)
        hole = location(tier, key(1))
        assert hole is not None
        os.close(tier._files.fds.pop(0))  # a crash: no close, no trim; key(1)'s object never landed
        assert tier._writer_lock is not None
        tier._writer_lock.close()
        with open(path, "r+b") as f:
            f.seek(hole[1])
            f.write(bytes(hole[2]))
        async with segments(tmp_path) as again:
            assert await again.contains([key(0), key(1), key(2)]) == [True, False, True]
            assert await again.get_bytes(key(2), 100_000) == payload(100_000, 2)

    asyncio.run(body())


def test_segments_work_where_files_cannot_be_preallocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without `fallocate`: said once, segments grow as they are written, and
    every put and get works."""
    import errno

    import tiers.file.segment_io

    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(tiers.file.segment_io.os, "posix_fallocate", refuse)

    async def body() -> None:
        async with segments(tmp_path, segment_size="4MiB") as tier:
            for i in range(3):
                await tier.put(key(i), payload(100_000, i))
            assert not tier._ledger.preallocating
            (path,) = tmp_path.rglob("*.kvs")
            assert path.stat().st_size == 3 * (104 << 10)  # as written, not preallocated
            assert await tier.get_bytes(key(2), 100_000) == payload(100_000, 2)

    asyncio.run(body())


def test_segments_a_block_deleted_while_being_written_stays_deleted(tmp_path: Path) -> None:
    async def body() -> None:
        async with segments(tmp_path) as tier:
            put = asyncio.ensure_future(tier.put(key(1), payload(100_000, 1)))
            await asyncio.sleep(0)  # the write is on its way
            await tier.delete(key(1))
            await put
            assert await tier.contains([key(1)]) == [False]
        async with segments(tmp_path) as again:
            assert await again.contains([key(1)]) == [False]

    asyncio.run(body())


def test_segments_a_failed_tombstone_does_not_fail_the_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block deleted while its put is in flight gets a tombstone once the put lands; when
    that write fails (an I/O error), the put still succeeded: it returns, and the failure is
    counted, not raised."""
    import errno

    import tiers.file.segment_io

    real = os.pwritev

    def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        if bytes(memoryview(buffers[0])[:10]) == b"KVTIERDEAD":
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(tiers.file.segment_io.os, "pwritev", pwritev)

    async def body() -> None:
        async with segments(tmp_path) as tier:
            put = asyncio.ensure_future(tier.put(key(1), payload(100_000, 1)))
            await asyncio.sleep(0)  # the write is on its way
            assert await tier.delete(key(1))
            await put  # raised TierUnavailable before
            assert tier.counters["tombstone_errors"] == 1
            assert await tier.contains([key(1)]) == [False]
            await tier.put(key(2), payload(4096, 2))  # the tier goes on working
            assert await tier.get_bytes(key(2), 4096) == payload(4096, 2)

    asyncio.run(body())


def test_segments_full_disk_fails_softly(tmp_path: Path) -> None:
    async def body() -> None:
        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        async with segments(tmp_path, min_free=free + (1 << 30)) as tier:
            with pytest.raises(TierFull, match="would leave less than min_free"):
                await tier.put(key(1), b"x" * 4096)
            assert await tier.contains([key(1)]) == [False]
            assert await tier.get_bytes(key(1), 4096) is None

    asyncio.run(body())


@pytest.mark.parametrize("aio", [True, False], ids=["kernel-aio", "threads"])
def test_segments_min_free_is_checked_when_space_is_taken(tmp_path: Path, aio: bool) -> None:
    """A preallocated segment's blocks were taken when it was created (with `min_free` checked
    then): puts into it take no more space and go on once the disk is short; the put that needs
    a new segment fails softly."""
    import mmap

    def slot(i: int) -> memoryview:  # a page-aligned slot, as the primary's
        view = memoryview(mmap.mmap(-1, 64 << 10))
        view[:] = payload(64 << 10, i)
        return view

    async def body() -> None:
        async with segments(tmp_path, segment_size="1MiB", direct=True, aio=aio) as tier:
            await tier.put(key(0), slot(0))
            assert tier._ledger.active is not None and tier._ledger.active.preallocated
            free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
            tier.min_free = free + (1 << 30)  # from now on the disk is short
            for i in range(1, 15):  # 15 records of 68 KiB fill the 1 MiB segment
                await tier.put(key(i), slot(i))
            with pytest.raises(TierFull, match="would leave less than min_free"):
                await tier.put(key(15), slot(15))
            assert await tier.contains([key(14), key(15)]) == [True, False]

    asyncio.run(body())


def test_unknown_layout_is_refused(tmp_path: Path) -> None:
    from tiering.errors import ConfigError

    with pytest.raises(ConfigError, match="layout: expected one of files, segments"):
        FileTier.variant({"layout": "log"})
    with pytest.raises(ConfigError, match="layout: expected one of files, segments"):
        BlockFileTier(namespace=NAMESPACE, path=tmp_path, layout="log")


def test_the_layout_option_chooses_the_class() -> None:
    assert FileTier.variant({}) is BlockFileTier
    assert FileTier.variant({"layout": "files", "min_free": "0"}) is BlockFileTier
    assert FileTier.variant({"layout": "segments", "segment_size": "1MiB"}) is SegmentFileTier
    assert SegmentFileTier.variant({}) is SegmentFileTier


def test_each_layout_takes_only_its_own_options(tmp_path: Path) -> None:
    """`segment_size` and `aio` with `layout: files` were once ignored without a word."""
    from tiering.errors import ConfigError

    for name, value in (("segment_size", "1MiB"), ("aio", False)):
        message = f"{name}: an option of layout segments, not of layout files"
        with pytest.raises(ConfigError, match=message):
            FileTier.variant({"layout": "files", name: value})
        with pytest.raises(ConfigError, match=message):
            FileTier.variant({name: value})  # files is the default
        with pytest.raises(ConfigError, match=message):
            BlockFileTier(namespace=NAMESPACE, path=tmp_path, **{name: value})
    with pytest.raises(ConfigError, match="layout: SegmentFileTier is layout segments"):
        SegmentFileTier(namespace=NAMESPACE, path=tmp_path, layout="files")
    with pytest.raises(ConfigError, match="segment_size: at least 4KiB"):
        SegmentFileTier(namespace=NAMESPACE, path=tmp_path / "s", segment_size=1024)
    assert not (tmp_path / "s").exists()  # refused before anything was made
    with pytest.raises(ConfigError, match="path: missing"):
        BlockFileTier(namespace=NAMESPACE)


@pytest.mark.parametrize("aio", [True, False], ids=["kernel-aio", "threads"])
def test_segments_move_a_batch_in_one_system_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aio: bool
) -> None:
    """Blocks put together lie back to back and come back together: one request to the disk
    for the batch (a pwritev or preadv in a pool thread, or one kernel AIO request), page-aligned
    slots of whole 4 KiB blocks, as the primary's are; a damaged or deleted block among them
    fails alone."""
    import mmap

    from tiers.file.aio import PWRITEV, KernelAio

    calls: dict[str, int] = {"pwritev": 0, "preadv": 0, "aio": 0}
    for name in ("pwritev", "preadv"):
        real = getattr(os, name)

        def counted(*args: Any, real: Any = real, name: str = name) -> Any:
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(os, name, counted)
    real_submit = KernelAio.submit

    def submitted(self: KernelAio, requests: Any) -> Any:
        calls["aio"] += len(requests)
        calls["pwritev" if requests[0][0] == PWRITEV else "preadv"] += len(requests)
        return real_submit(self, requests)

    monkeypatch.setattr(KernelAio, "submit", submitted)

    def slot(fill: bytes | None = None) -> memoryview:
        view = memoryview(mmap.mmap(-1, 64 << 10))
        if fill is not None:
            view[:] = fill
        return view

    async def body() -> None:
        async with segments(tmp_path, direct=True, aio=aio) as tier:
            await tier.put(key(99), slot(payload(64 << 10, 99)))  # the segment file is opened
            calls.update(pwritev=0, aio=0)
            assert (
                await tier.put_many([(key(i), slot(payload(64 << 10, i))) for i in range(8)])
                == [None] * 8
            )
            assert calls["pwritev"] == 1
            targets = [slot() for _ in range(8)]
            asked = [(key(i), targets[i]) for i in reversed(range(8))]  # any order: sorted
            found = await tier.get_many(asked)
            assert found == [True] * 8 and calls["preadv"] == 1
            assert calls["aio"] == (2 if aio else 0)  # kernel AIO is used where asked for
            assert all(bytes(targets[i]) == payload(64 << 10, i) for i in range(8))

            await tier.delete(key(2))
            where = location(tier, key(5))
            assert where is not None
            with open(where[0], "r+b") as f:  # a flipped byte in one payload
                f.seek(where[1] + 4096 + 100)
                f.write(b"\x00" if payload(64 << 10, 5)[100] else b"\x01")
            targets = [slot() for _ in range(8)]
            found = await tier.get_many([(key(i), targets[i]) for i in range(8)])
            assert found == [True, True, False, True, True, False, True, True]
            assert tier.counters["corrupt.checksum"] == 1
            assert all(bytes(targets[i]) == payload(64 << 10, i) for i in (0, 1, 3, 4, 6, 7))

    asyncio.run(body())


def test_segments_allow_one_writer_per_directory(tmp_path: Path) -> None:
    from tiering.errors import ConfigError

    async def body() -> None:
        async with segments(tmp_path) as tier:
            await tier.put(key(1), payload(10_000, 1))
            with pytest.raises(ConfigError, match="in use by another writer, pid [0-9]+ on host"):
                segments(tmp_path)
            async with segments(tmp_path, read_only=True) as reader:  # readers take no lock
                assert await reader.get_bytes(key(1), 10_000) == payload(10_000, 1)
        async with segments(tmp_path) as again:  # closed: the lock went with it
            assert await again.get_bytes(key(1), 10_000) == payload(10_000, 1)

    asyncio.run(body())


def test_a_config_chooses_the_segment_layout(tmp_path: Path) -> None:
    import yaml

    from tiering.config import parse_config
    from tiering.errors import ConfigError
    from tiering.manager import build_tiers

    text = f"""
version: 1
primary: {{capacity: 64MiB}}
tiers:
  - {{name: nvme, type: file, path: {tmp_path}, capacity: 1GiB, min_free: 0,
     layout: segments, segment_size: 32MiB, write: back}}
"""
    ((_, tier),) = build_tiers(parse_config(yaml.safe_load(text), {}), NAMESPACE)
    assert isinstance(tier, SegmentFileTier) and tier.segment_size == 32 << 20
    asyncio.run(tier.close())
    bad = text.replace("layout: segments", "layout: logs")
    with pytest.raises(ConfigError, match="layout: expected one of files, segments"):
        build_tiers(parse_config(yaml.safe_load(bad), {}), NAMESPACE)


# -- what an attacker with write access to the directory can put there --------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_fifo_in_place_of_an_object_is_a_corrupt_miss_not_a_hang(
    tmp_path: Path, direct: bool
) -> None:
    """A FIFO blocks whoever opens it for reading (a pool thread, for ever); a device reads
    without end. Each is refused as not an object, and removed, at once."""

    async def body() -> None:
        async with BlockFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=0, direct=direct, timeout=2
        ) as tier:
            await tier.put(key(2), payload(4096, 2))
            fifo = path_of(tier, key(1))
            os.mkfifo(fifo)
            start = asyncio.get_running_loop().time()
            assert await tier.get(key(1), bytearray(4096)) is False
            assert tier.counters["corrupt.magic"] == 1 and not fifo.exists()
            os.mkfifo(fifo)
            found = await tier.get_many([(key(1), bytearray(4096)), (key(2), bytearray(4096))])
            assert found == [False, True] and tier.counters["corrupt.magic"] == 2
            os.mkfifo(fifo)
            with pytest.raises(CorruptObject, match="not a regular file"):
                await tier.read_head(key(1))
            assert asyncio.get_running_loop().time() - start < 1.5
            assert tier.counters["errors"] == 0  # the object's fault, not the tier's

    asyncio.run(body())


def test_read_only_commands_and_a_restart_pass_fifos_by(tmp_path: Path) -> None:
    """FIFOs named like an object and like a segment file: kvtier stats, ls and inspect and a
    tier's start-up scan (an engine's start) go on instead of hanging."""
    import subprocess
    import sys

    async def body() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path / "f", min_free=0) as tier:
            await tier.put(key(2), payload(4096, 2))
            os.mkfifo(path_of(tier, key(2)).with_name(key(1).hex() + ".kv"))
        os.makedirs(tmp_path / "s" / NAMESPACE.hex())
        os.mkfifo(tmp_path / "s" / NAMESPACE.hex() / "00000007.kvs")
        for read_only in (True, False):
            segments = SegmentFileTier(
                namespace=NAMESPACE, path=tmp_path / "s", read_only=read_only
            )
            assert segments.damaged and segments.damaged[0][1] == "magic"
            await segments.close()

    asyncio.run(body())
    config = tmp_path / "c.yaml"
    config.write_text(f"tiers:\n  - {{name: f, type: file, path: '{tmp_path / 'f'}'}}\n")
    for args in (["stats"], ["ls", "--tier", "f"], ["inspect", "--tier", "f", key(1).hex()]):
        done = subprocess.run(
            [sys.executable, "-m", "kvtier", args[0], "--config", str(config), *args[1:]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (args, done.stderr)


def test_the_segment_scan_verifies_at_most_the_files_size_a_chunk_at_a_time(
    tmp_path: Path,
) -> None:
    """Headers at every 4 KiB of a sparse segment file, each claiming a payload of the whole
    file with a wrong checksum: the scan of the newest segments (which checks payloads) read
    each claim whole, 1 GiB of memory and a second per header; now one chunked pass."""
    import time
    import tracemalloc

    from tiering.testing import craft

    claim = 256 << 20
    root = tmp_path / NAMESPACE.hex()
    root.mkdir()
    with open(root / "00000000.kvs", "wb") as f:
        for _ in range((claim + (64 << 10)) // (64 << 10)):  # written, no hole: all checked
            f.write(b"\1" * (64 << 10))
        for i in range(8):
            head = craft(key(i), b"", stored=claim, raw=claim, checksum_of=b"x", align=4096)
            f.seek(i * 4096)
            f.write(head[:4096])
    tracemalloc.start()
    start = time.monotonic()
    try:
        tier = SegmentFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0, read_only=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.monotonic() - start
    asyncio.run(tier.close())
    assert peak < 16 << 20, peak
    assert [reason for _, reason, _ in tier.damaged] == ["checksum"]
    assert seconds < 10, seconds


def test_a_sparse_segment_whose_holes_headers_claim_is_scanned_by_the_bytes_it_holds(
    tmp_path: Path,
) -> None:
    """A 16 GiB sparse segment, the newest (whose payloads the scan checks), with a header at
    each GiB claiming the GiB after it: a writable tier's start read every claim, the whole
    apparent size (seconds per GiB); now it reads at most the bytes the file holds."""
    import time

    from tiering.testing import craft

    gib = 1 << 30
    root = tmp_path / NAMESPACE.hex()
    root.mkdir()
    segment = root / "00000000.kvs"
    with open(segment, "wb") as f:
        for i in range(16):
            claim = gib - 4096
            head = craft(key(i), b"", stored=claim, raw=claim, checksum_of=b"x", align=4096)
            f.seek(i * gib)
            f.write(head[:4096])
        f.truncate(16 * gib)
    held = segment.stat().st_blocks * 512
    assert held < 1 << 20, f"{tmp_path} does not keep holes: the test needs a file system that does"

    def read_so_far() -> int:  # bytes this process's read system calls returned
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))

    before, start = read_so_far(), time.monotonic()
    tier = SegmentFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0)
    read, seconds = read_so_far() - before, time.monotonic() - start
    asyncio.run(tier.close())
    assert read < 4 << 20, read
    assert seconds < 5, seconds


@pytest.mark.parametrize("space", ["fallocated", "sparse"])
def test_a_segment_allocated_and_never_written_is_scanned_by_the_data_written(
    tmp_path: Path, space: str
) -> None:
    """A 1 GiB segment, the newest (whose payloads the scan checks), allocated with
    `fallocate` (or stretched sparse) and never written but for headers: one at every 4 KiB
    of its first 64 KiB claiming the rest of the file, one at each 64 MiB claiming the 64 MiB
    after it. A writable tier's start read every claim of the fallocated file, allocated
    blocks that hold nothing (2 GiB read, 4 s here; 16 GiB took 74-94 s); now a payload with
    a hole is damaged unread, and the scan reads about the headers' bytes."""
    from tiering.testing import craft

    size, step = 1 << 30, 64 << 20
    root = tmp_path / NAMESPACE.hex()
    root.mkdir()
    segment = root / "00000000.kvs"
    with open(segment, "wb") as f:
        if space == "fallocated":
            os.posix_fallocate(f.fileno(), 0, size)
        else:
            f.truncate(size)
        heads = [(at, size - at - 4096) for at in range(0, 64 << 10, 4096)]
        heads += [(at, step - 4096) for at in range(step, size, step)]
        for i, (at, claim) in enumerate(heads):
            head = craft(key(i), b"", stored=claim, raw=claim, checksum_of=b"x", align=4096)
            f.seek(at)
            f.write(head[:4096])
    if space == "fallocated":
        assert segment.stat().st_blocks * 512 >= size

    def read_so_far() -> int:  # bytes this process's read system calls returned
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))

    before, start = read_so_far(), time.monotonic()
    tier = SegmentFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0)
    read, seconds = read_so_far() - before, time.monotonic() - start
    asyncio.run(tier.close())
    assert read < 4 << 20, read
    assert seconds < 1, seconds
    assert len(tier.damaged) == len(heads) and not tier._index


def test_an_object_outside_its_keys_directory_is_not_indexed(tmp_path: Path) -> None:
    """A valid object for a key with a 1-byte hash (no fan-out directory can name it), or any
    object in another directory than its key's: the scan leaves it out, so eviction, ls and
    verify never meet a key they cannot place."""
    from tiering.keys import make_key
    from tiering.tier.format import encode

    async def body() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0) as tier:
            for i in range(4):
                await tier.put(key(i), payload(8192, i))
            elsewhere = path_of(tier, key(0)).parent.parent / (key(5).hex() + ".kv")
        short = make_key(b"\x01")
        header, body_ = encode(short, NAMESPACE, payload(8192, 9), align=4096)
        (tmp_path / NAMESPACE.hex() / (short.hex() + ".kv")).write_bytes(header + bytes(body_))
        header, body_ = encode(key(5), NAMESPACE, payload(8192, 5), align=4096)
        elsewhere.write_bytes(header + bytes(body_))
        async with BlockFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=0, capacity=4 * 12288
        ) as again:
            assert sorted(reason for _, reason, _ in again.damaged) == ["key", "key"]
            for i in (10, 11):  # evicts: every victim has a place
                await again.put(key(i), payload(8192, i))
            # (the sweeper keeps a sixteenth of the capacity free: here, one block)
            assert (await again.stat()).objects in (3, 4)
            assert await again.contains([key(10), key(11)]) == [True, True]

    asyncio.run(body())


def test_a_huge_sparse_segment_is_scanned_in_moments(tmp_path: Path) -> None:
    """A segment file stretched to 64 GiB of holes after its objects: the scan skips holes
    without reading them (reading 64 GiB of zeros took minutes)."""
    import time

    async def body() -> None:
        async with SegmentFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=0, segment_size="1MiB"
        ) as tier:
            await tier.put(key(1), payload(8192, 1))
        (segment,) = (tmp_path / NAMESPACE.hex()).glob("*.kvs")
        with open(segment, "r+b") as f:
            f.truncate(64 << 30)
        start = time.monotonic()
        async with SegmentFileTier(
            namespace=NAMESPACE, path=tmp_path, min_free=0, read_only=True
        ) as again:
            assert await again.get_bytes(key(1), 8192) == payload(8192, 1)
        assert time.monotonic() - start < 5

    asyncio.run(body())
