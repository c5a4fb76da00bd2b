"""The pieces of a shared `files` directory (members, the byte count, the sweeper), what a
stranger can plant in `.kvtier`, a lock held for ever, a dead process's leftovers, and the
read-only tier, which takes no part."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiering.errors import TierFull
from tiering.testing import NAMESPACE, OTHER_NAMESPACE, key, payload
from tiers.file import BlockFileTier
from tiers.file.budget import STALE_ENTRY, Ledger, LedgerState
from tiers.file.credit import Credit
from tiers.file.files import TMP_MAX_AGE
from tiers.file.members import Members

ROOT = Path(__file__).resolve().parents[2]
SIZE = 64 << 10
ON_DISK = SIZE + 4096  # a block's file with O_DIRECT: a 4 KiB header, then the payload


def tier(path: Path, **options: object) -> BlockFileTier:
    return BlockFileTier(namespace=NAMESPACE, path=path, min_free=0, **options)  # type: ignore[arg-type]


def object_bytes(path: Path) -> int:
    """The bytes of the objects in `path` (one the sweeper removes meanwhile counts none)."""
    total = 0
    for found in path.rglob("*.kv"):
        try:
            total += found.stat().st_size
        except FileNotFoundError:
            continue
    return total


# -- the count -------------------------------------------------------------------------------------


def test_the_count_grants_room_within_the_capacity_and_drops_a_dead_writers(
    tmp_path: Path,
) -> None:
    """Room is granted while landed bytes and every reservation fit; an entry its writer has
    not rewritten for STALE_ENTRY seconds (a dead process's) is dropped and its room is free
    again; a ledger that does not parse counts as full until a scan."""
    capacity = 1 << 20
    ledger = Ledger(tmp_path, capacity, "t")

    def scanned(state: LedgerState) -> bool:
        state.flags = 0  # as the sweeper's scan leaves it
        return True

    ledger.update(scanned)
    first = Credit(ledger, b"a" * 8, capacity, lambda n: False, full_wait=0.05)
    second = Credit(ledger, b"b" * 8, capacity, lambda n: False, full_wait=0.05)
    first.take(600 << 10)
    with pytest.raises(TierFull, match="no room for"):
        second.take(600 << 10)
    first.landed(600 << 10)
    first.flush(closing=True)
    state = ledger.read()
    assert state is not None and state.used == 600 << 10 and not state.entries

    def dead_writer(state: LedgerState) -> bool:  # kill -9 while it held room
        state.entries[b"d" * 8] = (400 << 10, time.time() - STALE_ENTRY - 1)
        return True

    ledger.update(dead_writer)
    second.take(400 << 10)  # the dead writer's room is back
    state = ledger.read()
    assert state is not None and b"d" * 8 not in state.entries
    ledger.path.write_bytes(b"garbage" * 100)
    with pytest.raises(TierFull):
        second.take(4096 + (1 << 20))
    state = ledger.read()
    assert state is not None and state.needs_scan and state.used == capacity
    ledger.close()


_WHOLE = LedgerState(used=5, entries={b"a" * 8: (1, 1.0)}).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"KVTBUDGT",
        b"\xff" * 4096,
        _WHOLE[:80],
        _WHOLE[:20] + bytes([_WHOLE[20] ^ 1]) + _WHOLE[21:],
        _WHOLE.replace(b"KVTBUDGT\x01", b"KVTBUDGT\x02"),
    ],
    ids=["empty", "magic-only", "ones", "cut", "flipped", "newer"],
)
def test_a_ledger_that_does_not_parse_is_refused(raw: bytes) -> None:
    """Only a whole ledger this version wrote is believed (a flipped bit, a cut, a newer
    format: refused)."""
    assert LedgerState.decode(_WHOLE) is not None
    assert LedgerState.decode(raw) is None


# -- what a stranger can plant in .kvtier ----------------------------------------------------------


def _plant(base: Path, where: str, what: str, outside: Path) -> None:
    """Put `what` (garbage, huge, fifo, symlink, directory) at `.kvtier/<where>`."""
    meta = base / ".kvtier"
    path = meta / where if where else meta
    if where:
        path.parent.mkdir(parents=True, exist_ok=True)
    if what == "garbage":
        path.write_bytes(os.urandom(10_000))
    elif what == "huge":
        with open(path, "wb") as f:
            f.write(os.urandom(100))
            f.truncate(64 << 30)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "symlink":
        outside.write_bytes(b"not kvtier's")
        path.symlink_to(outside)
    elif what == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")


@pytest.mark.parametrize(
    "where,what",
    [
        ("", "garbage"),
        ("", "fifo"),
        ("", "symlink"),
        ("budget-v1", "garbage"),
        ("budget-v1", "huge"),
        ("budget-v1", "fifo"),
        ("budget-v1", "symlink"),
        ("sweeper.lock", "garbage"),
        ("sweeper.lock", "fifo"),
        ("sweeper.lock", "symlink"),
        ("sweeper.lock", "directory"),
        (f"members/{NAMESPACE.hex()}.0123456789abcdef.member", "fifo"),
        (f"members/{NAMESPACE.hex()}.0123456789abcdef.member", "symlink"),
        (f"members/{NAMESPACE.hex()}.0123456789abcdef.member", "directory"),
        (f"members/{NAMESPACE.hex()}.0123456789abcdef.member", "garbage"),
        ("members", "symlink"),
    ],
)
def test_a_crafted_file_in_the_directorys_own_place_neither_crashes_nor_hangs(
    tmp_path: Path, where: str, what: str
) -> None:
    """Whatever lies where kvtier keeps its own files (garbage, a huge sparse file, a FIFO,
    a symlink to someone else's file, a directory): a tier with a capacity starts, writes past
    its capacity, reads, and closes in moments; a symlink's target is left as it was; and
    the directory stays bounded."""
    base = tmp_path / "d"
    base.mkdir()
    outside = tmp_path / "outside"
    _plant(base, where, what, outside)
    capacity = 1 << 20
    start = time.monotonic()

    async def body() -> None:
        async with tier(base, capacity=capacity, timeout=2) as t:
            for at in range(0, 24, 4):
                batch = [(key(i), payload(SIZE, i)) for i in range(at, at + 4)]
                assert await t.put_many(batch) == [None] * 4
            assert await t.get_bytes(key(23), SIZE) == payload(SIZE, 23)

    asyncio.run(body())
    assert time.monotonic() - start < 20
    if what == "symlink":
        assert outside.read_bytes() == b"not kvtier's"
    assert object_bytes(base) <= capacity


def test_a_budget_lock_held_for_ever_fails_puts_in_bounded_time(tmp_path: Path) -> None:
    """A process that holds the count's lock and never lets go (stopped, say) cannot hang
    the tiers of the directory: puts are TierFull within their wait, reads go on."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "os.makedirs(sys.argv[1], exist_ok=True)\n"
            "fd = os.open(sys.argv[1] + '/budget-v1', os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
            str(tmp_path / ".kvtier"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"

        async def body() -> None:
            async with tier(tmp_path, capacity=1 << 20, timeout=1) as t:
                start = time.monotonic()
                with pytest.raises(TierFull):
                    await t.put(key(1), payload(SIZE, 1))
                assert time.monotonic() - start < 1.5
                assert await t.get(key(1), bytearray(SIZE)) is False

        asyncio.run(body())
    finally:
        holder.kill()
        holder.communicate()


# -- a dead process's leftovers -------------------------------------------------------------------


def test_a_killed_writers_member_file_is_recovered(tmp_path: Path) -> None:
    """A writer killed with -9 leaves its member file behind, unlocked: the next look by a
    writable tier takes it for a dead member's and removes it (and still takes itself for not
    alone: its index lacks what the dead one wrote)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from tiers.file.members import Members\n"
            "Members(__import__('pathlib').Path(sys.argv[1]), bytes(16), b'12345678', join=True,"
            " name='x')\n"
            "print('in', flush=True)\n"
            "time.sleep(60)\n",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "in\n"
    left = tmp_path / ".kvtier" / "members" / f"{bytes(16).hex()}.{b'12345678'.hex()}.member"
    try:
        watcher = Members(tmp_path, bytes(16), b"watcher!", join=True, name="w")
        assert not watcher.alone and watcher.others == 1
        child.kill()
        child.wait()
        assert left.exists()
        watcher.refresh()
        assert watcher.others == 0 and not left.exists() and not watcher.alone
        watcher.leave()
    finally:
        child.kill()
        child.communicate()


def test_the_first_scan_counts_what_is_there_and_evicts_down_to_the_capacity(
    tmp_path: Path,
) -> None:
    """Objects on the disk that no count knows (written by an older kvtier, or a capacity
    lowered since), and a killed writer's temporary file older than TMP_MAX_AGE: the
    directory's sweeper counts the one, removes the other, and evicts the oldest first."""

    async def body() -> None:
        async with tier(tmp_path) as unbounded:
            for i in range(20):
                await unbounded.put(key(i), payload(SIZE, i))
                os.utime(unbounded._path(key(i)), (1000 + i, 1000 + i))
            left = unbounded._path(key(0)).with_name(".leftover.123.0.tmp")
            left.write_bytes(b"half a block")
            os.utime(left, (time.time() - TMP_MAX_AGE - 60,) * 2)
        capacity = 10 * ON_DISK
        async with tier(tmp_path, capacity=capacity) as bounded:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (
                object_bytes(tmp_path) > capacity or bounded.counters["evictions"] < 10
            ):  # (a sweep counts its evictions once it has made them all)
                await asyncio.sleep(0.02)
            assert object_bytes(tmp_path) <= capacity
            present = await bounded.contains([key(i) for i in range(20)])
            assert not any(present[:5]) and all(present[-9:]), present
            assert not left.exists()
            assert bounded.counters["evictions"] >= 10

    asyncio.run(body())


def test_the_capacity_counts_every_namespace_of_the_directory(tmp_path: Path) -> None:
    """One disk, one budget: a tier of another namespace writing the directory evicts this
    namespace's least recently used blocks, and the directory stays within the capacity."""
    capacity = 12 * ON_DISK

    async def body() -> None:
        async with (
            tier(tmp_path, capacity=capacity) as ours,
            BlockFileTier(
                namespace=OTHER_NAMESPACE, path=tmp_path, min_free=0, capacity=capacity
            ) as theirs,
        ):
            for i in range(10):
                await ours.put(key(i), payload(SIZE, i))
            for i in range(10):
                await theirs.put(key(100 + i), payload(SIZE, i))
            assert object_bytes(tmp_path) <= capacity
            ours_left = [ours._path(key(i)).exists() for i in range(10)]
            assert not ours_left[0] and sum(ours_left) < 10, ours_left
            assert all(theirs._path(key(100 + i)).exists() for i in range(10))
            assert await ours.get(key(0), bytearray(SIZE)) is False  # a read finds it gone
            assert ours.knows(key(0)) is False  # alone: another namespace shares no block

    asyncio.run(body())


# -- the read-only tier ----------------------------------------------------------------------------


def test_a_read_only_tier_takes_no_part(tmp_path: Path) -> None:
    """A read-only tier creates nothing (no `.kvtier`, no member's file, no role), refreshes
    no recency with its hits, and still learns that another process writes the directory
    (so it asks the disk for keys its index lacks)."""

    async def body() -> None:
        async with tier(tmp_path / "empty", read_only=True, capacity=1 << 20) as reader:
            assert await reader.contains([key(1)]) == [False]
        assert not (tmp_path / "empty").exists()
        async with tier(tmp_path, capacity=1 << 20) as writer:
            await writer.put(key(1), payload(SIZE, 1))
            mtime = writer._path(key(1)).stat().st_mtime_ns
            members = sorted((tmp_path / ".kvtier" / "members").iterdir())
            lock = tmp_path / ".kvtier" / "sweeper.lock"
            holder = lock.read_bytes()
            async with tier(tmp_path, read_only=True, capacity=1 << 20) as reader:
                assert reader.knows(key(2)) is None  # a writer is alive: ask the disk
                await writer.put(key(2), payload(SIZE, 2))
                assert await reader.contains([key(2)]) == [True]
                assert await reader.get_bytes(key(1), SIZE) == payload(SIZE, 1)
                assert writer._path(key(1)).stat().st_mtime_ns == mtime
                assert sorted((tmp_path / ".kvtier" / "members").iterdir()) == members
                assert lock.read_bytes() == holder
                assert reader._shared.sweeper is None and reader._shared.credit is None

    asyncio.run(body())


def test_hits_refresh_recency_for_the_sweeper(tmp_path: Path) -> None:
    """A writable tier with a capacity sets a block's mtime when it reads it, and when it
    writes it, to the nanosecond: one recency order for every engine's sweeper."""

    async def body() -> None:
        async with tier(tmp_path, capacity=1 << 20) as t:
            await t.put(key(1), payload(SIZE, 1))
            path = t._path(key(1))
            os.utime(path, (1000, 1000))
            assert await t.get_bytes(key(1), SIZE) == payload(SIZE, 1)
            assert time.time() - path.stat().st_mtime < 5
            os.utime(path, (1000, 1000))
            found = await t.get_many([(key(1), bytearray(SIZE)), (key(2), bytearray(SIZE))])
            assert found == [True, False]
            assert time.time() - path.stat().st_mtime < 5

    asyncio.run(body())


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "link"])
def test_a_name_is_given_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: bool
) -> None:
    """A finished temporary file takes its final name only if the name is free, by
    renameat2's RENAME_NOREPLACE or, where a file system refuses the flag, a hard link; the
    temporary name is gone either way, and the first file stays whole."""
    from tiers.file import once

    if not renameat2:
        monkeypatch.setattr(once, "_renameat2", None)
    final = tmp_path / "block.kv"
    for n, expected in ((1, True), (2, False)):
        tmp = tmp_path / f".block.{n}.tmp"
        tmp.write_bytes(b"writer %d" % n)
        assert once.place_once(tmp, final) is expected
        assert not tmp.exists()
    assert final.read_bytes() == b"writer 1"


_WRITE_AND_LEAVE = """
import asyncio, sys, time
from pathlib import Path
from tiers.file import BlockFileTier
from tiering.testing import NAMESPACE, key, payload

async def main():
    async with BlockFileTier(namespace=NAMESPACE, path=sys.argv[1], min_free=0) as tier:
        print("in", flush=True)
        sys.stdin.readline()
        await tier.put(key(7), payload(4096, 7))
asyncio.run(main())
"""


def test_a_tier_once_beside_another_finds_its_blocks_after_it_left(tmp_path: Path) -> None:
    """Engine B writes a block beside engine A and stops; A's index never held the block,
    and A is alone again: it still finds the block on the disk (a tier once beside another
    stays 'not alone' for its life)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITE_AND_LEAVE, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    async def body() -> None:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "in\n"
        async with tier(tmp_path) as a:
            deadline = time.monotonic() + 10
            while a.knows(key(99)) is not None:  # A learns of B within MEMBERS_EVERY
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait(timeout=30) == 0
            await asyncio.sleep(1.5)  # past A's next look at the members: B has gone
            assert a._shared.members.others == 0
            assert await a.contains([key(7)]) == [True]
            assert await a.get_bytes(key(7), 4096) == payload(4096, 7)

    try:
        asyncio.run(body())
    finally:
        child.kill()
        child.communicate()


def test_a_link_in_an_objects_place_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """A symbolic link planted at a key's name is no object: a read refuses it without
    following it (a hit's recency stamp would change the target's mtime), and the target
    stays as it was."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"someone's file")
    os.utime(target, (1000, 1000))

    async def body() -> None:
        async with tier(tmp_path / "t", capacity=1 << 30) as t:
            path = t._path(key(3))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(target)
            assert await t.get_bytes(key(3), 4096) is None
            assert t.counters["corrupt.magic"] == 1
            assert await t.contains([key(3)]) == [False]

    asyncio.run(body())
    assert target.stat().st_mtime == 1000 and target.read_bytes() == b"someone's file"


def test_a_neighbours_refused_key_does_not_come_back_with_a_duplicate_put(tmp_path: Path) -> None:
    """An object under another secret is refused and left in place; the put this engine
    then makes of the same key finds it there (a duplicate): the key must not enter the
    index again, or every lookup would wait for a promotion that can only be refused."""
    from tiering.testing import OTHER_SECRET, SECRET

    async def body() -> None:
        async with tier(tmp_path, secret=OTHER_SECRET) as neighbour:
            await neighbour.put(key(5), payload(4096, 5))
        async with tier(tmp_path, secret=SECRET) as t:
            assert t.knows(key(5)) is True  # from the start scan (headers only)
            assert await t.get_bytes(key(5), 4096) is None
            assert t.counters["corrupt.auth"] == 1
            await t.put(key(5), payload(4096, 5))
            assert t.counters["duplicates"] == 1
            assert t.knows(key(5)) is not True

    asyncio.run(body())


def test_a_sweep_is_bounded_in_time_however_slow_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep with thousands of files to remove on a slow disk stops within its time (the
    rest is the next pass's), and a close during it returns promptly: a writer's put waits at
    most its bound, and the engine's close its own."""
    import tiers.file.sweeper as sweeper_module

    async def body() -> None:
        async with tier(tmp_path) as unbounded:
            await unbounded.put_many([(key(i), payload(4096, i)) for i in range(300)])
        t = tier(tmp_path, capacity=8 * 8192)
        try:
            sweeper = t._shared.sweeper
            assert sweeper is not None
            deadline = time.monotonic() + 10
            while not sweeper.holding:  # the role, taken on the housekeeping thread
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            slow_unlink = os.unlink

            def unlink(path: object) -> None:
                time.sleep(0.05)
                slow_unlink(path)  # type: ignore[arg-type]

            monkeypatch.setattr(sweeper_module.os, "unlink", unlink)
            began = time.monotonic()
            sweeper.sweep(seconds=0.3, wait=5.0)
            assert time.monotonic() - began < 1.5
        finally:
            began = time.monotonic()
            await t.close()
            assert time.monotonic() - began < 3.0

    asyncio.run(body())


def test_a_sweep_that_scans_again_midway_leaves_the_count_exact(tmp_path: Path) -> None:
    """A pass that runs out of its scan's files after removing some scans again: the files it
    removed are taken off the count before the new scan counts the directory, not after it
    (which would take them off twice and leave the count low)."""

    def on_disk() -> int:
        return sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))

    async def body() -> None:
        async with tier(tmp_path) as unbounded:
            await unbounded.put_many([(key(i), payload(4096, i)) for i in range(40)])
        size = on_disk() // 40
        t = tier(tmp_path, capacity=64 * size)
        try:
            sweeper = t._shared.sweeper
            assert sweeper is not None
            deadline = time.monotonic() + 10
            while not (sweeper.holding and sweeper.scans):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            with sweeper._sweeping:
                sweeper._candidates = sweeper._candidates[:2]  # a heap's prefix is a heap
                sweeper.capacity = 30 * size  # 10 to remove: 2 of them, then a scan
            sweeper.sweep(wait=5.0)
            state = t._shared.credit.ledger.read()  # type: ignore[union-attr]
            assert state is not None
            assert on_disk() <= 30 * size
            assert state.used == on_disk(), (state.used, on_disk())
        finally:
            await t.close()

    asyncio.run(body())
