"""Several processes on one file tier directory at the same time, as a node's engines use it:
blocks one stores are found by the others while they run (within the bound DESIGN.md states),
a `files` directory stays within its capacity with three writers, least recently used first,
its sweeper's role moves when its holder is killed, a key is written once however many write
it (a write that finds the file is a use of it), and the `segments` layout refuses a second
writer, naming the first."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.file_children import IDLE, PRELUDE, Children, directory_bytes
from tests.helpers.manager import PENDING, Harness, k
from tiering.config import TierConfig
from tiering.errors import ConfigError
from tiering.manager.locator import NEGATIVE_TTL
from tiering.primary import LookupResult
from tiering.testing import NAMESPACE, key, payload
from tiers.file import BlockFileTier, SegmentFileTier
from tiers.file.locks import read_holder
from tiers.file.members import MEMBERS_EVERY
from tiers.file.sweeper import ROLE_EVERY

_WRITER = (
    PRELUDE
    + """
from tests.helpers.manager import k

async def main():
    async with BlockFileTier(namespace=NAMESPACE, path=args["path"], min_free=0) as tier:
        say(ready=os.getpid())
        wait_for_go()
        stored = []
        for i, at in enumerate(args["at"]):
            while time.time() < at:
                await asyncio.sleep(0.001)
            await tier.put(k(args["first"] + i), payload(4096, i))
            stored.append(time.time())
        say(stored=stored)
        while not Path(args["stop"]).exists():
            await asyncio.sleep(0.01)

asyncio.run(main())
"""
)

_FILLER = (
    PRELUDE
    + """
async def main():
    size, batch = args["size"], args["batch"]
    async with BlockFileTier(
        namespace=NAMESPACE, path=args["path"], min_free=0, capacity=args["capacity"]
    ) as tier:
        say(ready=os.getpid())
        wait_for_go()
        first, hot = args["first"], args["hot"]
        used, failed = {}, 0  # each block's last write or hit, as seen once it has ended
        end = time.monotonic() + args.get("seconds", 1e9)
        for at in range(0, args["blocks"], batch):
            if time.monotonic() > end:
                break
            ids = range(first + at, first + min(at + batch, args["blocks"]))
            results = await tier.put_many([(key(i), payload(size, i)) for i in ids])
            now = time.time()
            for i, result in zip(ids, results):
                if result is None:
                    used[i] = now
                else:
                    failed += 1
                    print("put failed:", result, file=sys.stderr)
            ids = [first + j for j in range(hot)]
            found = await tier.get_many([(key(i), bytearray(size)) for i in ids])
            now = time.time()
            for i, hit in zip(ids, found):
                if hit is True:
                    used[i] = now
        say(used=used, failed=failed, counters=dict(tier.counters))
        while not Path(args["stop"]).exists():
            await asyncio.sleep(0.01)

asyncio.run(main())
"""
)

_SAME_KEYS = (
    PRELUDE
    + """
async def main():
    size, n = args["size"], args["blocks"]
    async with BlockFileTier(namespace=NAMESPACE, path=args["path"], min_free=0) as tier:
        say(ready=os.getpid())
        wait_for_go()
        for at in range(0, n, 8):
            results = await tier.put_many(
                [(key(i), payload(size, i)) for i in range(at, min(at + 8, n))]
            )
            assert results == [None] * len(results), results
        say(counters=dict(tier.counters))

asyncio.run(main())
"""
)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    made = Children(tmp_path)
    yield made
    made.close()


# -- live sharing ---------------------------------------------------------------------------------


def test_a_tier_finds_what_another_process_writes_while_both_run(
    tmp_path: Path, children: Children
) -> None:
    """While another process writes the directory, the tier's index is not the whole truth:
    `knows` says so (None) for a key it lacks, `contains` and `get` find the other process's
    blocks (and its `knows` then does), and a block the other process removes stops being
    known once a read finds it gone; once the other process has gone, `knows` still asks the
    disk (None) for a key the index lacks: what it wrote is not in the index."""

    async def body() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path / "d", min_free=0) as tier:
            assert tier.knows(k(1)) is False  # alone: the index is the whole truth
            writer = children.start(_WRITER, path=str(tmp_path / "d"), first=1, at=[0, 0, 0])
            children.line(writer)
            children.release()
            stored = children.line(writer)["stored"]
            assert len(stored) == 3
            deadline = time.monotonic() + MEMBERS_EVERY + 2
            while tier.knows(k(1)) is False and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert tier.knows(k(1)) is None  # another process writes here: ask the disk
            assert await tier.contains([k(1), k(2), k(9)]) == [True, True, False]
            assert tier.knows(k(1)) is True and tier.knows(k(9)) is None
            assert await tier.get_bytes(k(3), 4096) == payload(4096, 2)  # not indexed yet
            assert tier.knows(k(3)) is True
            assert tier.counters["hits_other_writer"] == 1
            tier._path(k(2)).unlink()  # the other engine's sweeper evicted it, say
            assert await tier.get(k(2), bytearray(4096)) is False
            assert tier.knows(k(2)) is None
            children.stop.touch()
            writer.wait(timeout=20)
            await asyncio.sleep(MEMBERS_EVERY + 0.5)  # past the next look: the writer gone
            # still not the whole truth: the index lacks what the writer wrote
            assert tier.knows(k(9)) is None and tier.knows(k(1)) is True

    asyncio.run(body())


def test_an_engine_alone_pays_no_retry_and_one_beside_another_finds_its_blocks(
    tmp_path: Path,
) -> None:
    """The manager over a files tier: alone, a key the index lacks is a MISS at once (no
    existence check, no step deferred); with another writer of the directory, it is RETRY,
    then PENDING once the check has found the other's block."""
    tier = BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0)
    h = Harness([(TierConfig(name="disk", type="file", write="through"), tier)], slots=16)
    try:
        assert h.manager.lookup(k(1)) is LookupResult.MISS
        h.end_step()
        assert tier.counters["lookups"] == 0 and not h.manager.locator.checking
        other = BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0)
        asyncio.run(other.put(k(1), bytes(4096)))
        deadline = time.monotonic() + MEMBERS_EVERY + 2
        while tier.knows(k(1)) is False and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = h.lookup_until(1, PENDING)
        assert seen[0] is LookupResult.RETRY, seen
        asyncio.run(other.close())
    finally:
        h.close()


def test_a_block_another_engine_stores_is_found_within_the_bound(
    tmp_path: Path, children: Children
) -> None:
    """Visibility, measured with two processes at the same time: engine B (a tiering manager
    over the directory, looking its keys up every step) finds each block engine A stores
    within NEGATIVE_TTL (a key B found absent is not looked for again before then) plus one
    existence check. B looks the keys up before A stores them, so the bound is met, not
    dodged."""
    path = tmp_path / "d"
    tier = BlockFileTier(namespace=NAMESPACE, path=path, min_free=0)
    h = Harness([(TierConfig(name="disk", type="file", write="through"), tier)], slots=64)
    n = 24
    try:
        start = time.time() + 1.5
        at = [start + 0.12 * i for i in range(n)]
        writer = children.start(_WRITER, path=str(path), first=0, at=at)
        children.line(writer)
        children.release()
        found: dict[int, float] = {}
        deadline = time.monotonic() + 20
        while len(found) < n and time.monotonic() < deadline:
            for i in range(n):
                if i not in found and h.manager.lookup(k(i)) in (PENDING, LookupResult.HIT):
                    found[i] = time.time()
            h.end_step()
            time.sleep(0.005)
        stored = children.line(writer)["stored"]
    finally:
        h.close()
    assert len(found) == n, f"found {sorted(found)} of {n}"
    delays = [found[i] - stored[i] for i in range(n)]
    print(
        f"visibility: median {statistics.median(delays):.3f}s, max {max(delays):.3f}s "
        f"(NEGATIVE_TTL {NEGATIVE_TTL}s)"
    )
    assert max(delays) <= NEGATIVE_TTL + 1.0, delays
    assert min(delays) >= 0


# -- a bounded directory --------------------------------------------------------------------------


def test_three_writers_keep_the_directory_within_capacity_least_recently_used_first(
    tmp_path: Path, children: Children
) -> None:
    """Three processes write one directory with a small capacity at the same time, each
    reading its first blocks again after every batch: sampled from the disk throughout, the
    directory never holds more than its capacity plus one batch; the blocks read stay, and
    of the others the ones gone are the oldest (least recently used first, by one rule: a
    single sweeper evicted them all)."""
    path = tmp_path / "d"
    size, batch, capacity, blocks, hot = 64 << 10, 4, 4 << 20, 96, 3
    one_batch = batch * (size + 4096)
    writers = [
        children.start(
            _FILLER,
            path=str(path),
            capacity=capacity,
            size=size,
            batch=batch,
            blocks=blocks,
            first=1000 * w,
            hot=hot,
        )
        for w in range(3)
    ]
    for w in writers:
        children.line(w)
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], directory_bytes(path))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        children.release()
        reports = [children.line(w, timeout=120) for w in writers]
    finally:
        done.set()
        watcher.join()
    assert all(r["failed"] == 0 for r in reports), [r["failed"] for r in reports]
    assert peak[0] <= capacity + one_batch, (peak[0], capacity)
    evicting = [r["counters"].get("evictions", 0) for r in reports]
    assert sum(evicting) > 0 and sum(e > 0 for e in evicting) == 1, evicting
    on_disk = {p.name[:-3] for p in path.rglob("*.kv")}
    used = {int(i): t for r in reports for i, t in r["used"].items()}
    assert len(used) == 3 * blocks
    gone = [t for i, t in used.items() if key(i).hex() not in on_disk]
    kept = [t for i, t in used.items() if key(i).hex() in on_disk]
    assert gone and kept
    # Each time is taken once its write or read has ended (its mtime was set before): a block
    # used last before another that stayed was removed first, up to that gap.
    print(f"LRU margin: {min(kept) - max(gone):+.3f}s")
    assert max(gone) <= min(kept) + 0.25, "a block was evicted before one used less recently"


def test_the_sweeper_role_moves_when_its_holder_is_killed(
    tmp_path: Path, children: Children
) -> None:
    """The sweeper is whoever holds the lock: kill -9 its holder, and another tier of the
    directory takes the role within ROLE_EVERY and keeps the directory bounded while it
    writes on."""
    path = tmp_path / "d"
    capacity, size = 2 << 20, 64 << 10
    holder = children.start(IDLE, path=str(path), capacity=capacity)
    holder_pid = children.line(holder)["ready"]
    lock = path / ".kvtier" / "sweeper.lock"
    assert read_holder(lock).startswith(f"pid {holder_pid} ")
    writer = children.start(
        _FILLER,
        path=str(path),
        capacity=capacity,
        size=size,
        batch=4,
        blocks=400,
        first=0,
        hot=0,
        seconds=4.0,
    )
    writer_pid = children.line(writer)["ready"]
    children.release()
    time.sleep(1.0)
    os.kill(holder_pid, signal.SIGKILL)
    holder.wait(timeout=10)
    killed = time.monotonic()
    while not read_holder(lock).startswith(f"pid {writer_pid} "):
        assert time.monotonic() - killed < ROLE_EVERY + 2, read_holder(lock)
        time.sleep(0.01)
    report = children.line(writer, timeout=60)
    assert report["counters"].get("evictions", 0) > 0  # it swept once it held the role
    assert report["failed"] == 0, report
    assert directory_bytes(path) <= capacity + 4 * (size + 4096)


# -- write once ---------------------------------------------------------------------------------


def test_two_engines_writing_the_same_keys_at_once_write_each_once(
    tmp_path: Path, children: Children
) -> None:
    """Two processes put the same 64 blocks at the same time, in batches: each key's file is
    written by one of them only (the other's put is a duplicate: nothing written, counted),
    and every file is whole."""
    path = tmp_path / "d"
    size, n = 64 << 10, 64
    writers = [children.start(_SAME_KEYS, path=str(path), size=size, blocks=n) for _ in range(2)]
    for w in writers:
        children.line(w)
    children.release()
    counters = [children.line(w)["counters"] for w in writers]
    assert sum(c.get("puts", 0) for c in counters) == 2 * n
    assert sum(c.get("bytes_written", 0) for c in counters) == n * size, counters
    assert sum(c.get("duplicates", 0) for c in counters) == n, counters
    assert sum(c.get("duplicate_bytes", 0) for c in counters) == n * size
    assert not list(path.rglob("*.tmp"))

    async def check() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=path, read_only=True) as reader:
            buffers = [bytearray(size) for _ in range(n)]
            assert await reader.get_many([(key(i), buffers[i]) for i in range(n)]) == [True] * n
            assert all(bytes(buffers[i]) == payload(size, i) for i in range(n))

    asyncio.run(check())


def test_a_write_that_finds_another_engines_file_refreshes_its_recency(tmp_path: Path) -> None:
    """A put of a block another engine's file holds writes nothing but is a use, as a hit is:
    the file's mtime becomes now, so the sweeper (least recently used first, by mtime) sees
    every engine that stores the block (issue 44). A tier with no capacity sweeps nothing and
    leaves the mtime."""

    async def check(capacity: int | None) -> float:
        options = {"namespace": NAMESPACE, "path": tmp_path / str(capacity), "min_free": 0}
        async with BlockFileTier(**options, capacity=capacity) as first:
            async with BlockFileTier(**options) as second:
                await first.put(key(1), payload(4096, 1))
                (path,) = (tmp_path / str(capacity)).rglob("*.kv")
                old = time.time() - 3600
                os.utime(path, (old, old))
                await second.put(key(1), payload(4096, 1))
                assert second.counters["duplicates"] == 1
                return path.stat().st_mtime - old

    assert asyncio.run(check(1 << 20)) > 3500
    assert asyncio.run(check(None)) == 0


# -- the segment layout: one writer --------------------------------------------------------------


def test_a_second_segments_writer_is_refused_naming_the_directory_and_its_holder(
    tmp_path: Path, children: Children
) -> None:
    """A second writable engine on a segment directory another process writes gets one line
    at start: the directory, and the holder's pid, host and start; a reader is let in."""
    holder = children.start(IDLE, path=str(tmp_path), layout="segments")
    pid = children.line(holder)["ready"]
    with pytest.raises(ConfigError) as refused:
        SegmentFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0)
    message = str(refused.value)
    assert "\n" not in message
    assert str(tmp_path / NAMESPACE.hex()) in message
    assert f"pid {pid} on host " in message and " since 20" in message, message
    reader = SegmentFileTier(namespace=NAMESPACE, path=tmp_path, read_only=True)
    asyncio.run(reader.close())
