"""Several engines on one bucket at the same time (real processes, real SeaweedFS): what one
writes, another finds within the stated bound; a writer killed mid-run loses at most
`pack_after`; a prefix with `capacity` stays within it, oldest first, swept by one engine whose
lease moves when it dies; engines writing the same keys write each once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.servers import SeaweedS3
from tests.tiers.s3_tiers import s3_tier
from tiering.testing import NAMESPACE, key, payload
from tiers.s3.lease import LEASE_NAME
from tiers.s3.sweeper import sweepable

pytestmark = [pytest.mark.s3, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """One `tests.tiers.s3_fleet_worker` process (test process)."""

    def __init__(self, fleet: Fleet, name: str, spec: dict[str, Any]) -> None:
        self.log = fleet.dir / f"{name}.log"
        self.err = fleet.dir / f"{name}.err"
        self.status = fleet.dir / f"{name}.json"
        full = {
            "endpoint": fleet.server.endpoint,
            "bucket": fleet.server.bucket,
            "access_key": fleet.server.ACCESS_KEY,
            "secret_key": fleet.server.SECRET_KEY,
            "prefix": fleet.prefix,
            "log": str(self.log),
            "status": str(self.status),
            "go": str(fleet.go),
            **spec,
        }
        with open(self.err, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.tiers.s3_fleet_worker", json.dumps(full)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stderr=err,
            )

    def lines(self, word: str) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [
            line.split()[1:]
            for line in self.log.read_text().splitlines()
            if line.split()[:1] == [word]
        ]

    def events(self, word: str) -> dict[int, float]:
        return {int(i): float(t) for i, t in self.lines(word)}

    def state(self) -> dict[str, Any]:
        return json.loads(self.status.read_text()) if self.status.exists() else {}

    def counters(self) -> dict[str, int]:
        return self.state().get("counters", {})


class Fleet:
    """Workers on one prefix of the test server, started together (test process)."""

    def __init__(self, server: SeaweedS3, dir: Path) -> None:
        self.server = server
        self.dir = dir
        self.prefix = f"fleet-{uuid.uuid4().hex[:8]}/"
        self.go = dir / "go"
        self.workers: list[Worker] = []
        self.started = 0
        self.client: Any = server.client()

    def add(self, name: str, **spec: Any) -> Worker:
        worker = Worker(self, name, spec)
        self.workers.append(worker)
        return worker

    def start(self) -> float:
        """Wait until every worker is ready, then let them all go at once: the time."""
        new, self.started = self.workers[self.started :], len(self.workers)
        self.go.unlink(missing_ok=True)
        deadline = time.monotonic() + 60
        while not all(w.lines("ready") for w in new):
            for w in new:
                assert w.process.poll() is None, w.err.read_text()
            assert time.monotonic() < deadline, "workers not ready"
            time.sleep(0.05)
        self.go.touch()
        return time.time()

    def wait(self, timeout: float = 120) -> None:
        for w in self.workers:
            assert w.process.wait(timeout=timeout) == 0, w.err.read_text()

    def stop(self) -> None:
        for w in self.workers:
            if w.process.poll() is None:
                w.process.kill()
                w.process.wait()

    def listing(self) -> dict[str, tuple[int, float]]:
        """Every kvtier object under the prefix: name -> (size, LastModified)."""
        found = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.server.bucket, Prefix=self.prefix
        ):
            for item in page.get("Contents", []):
                if sweepable(item["Key"][len(self.prefix) :]):
                    found[item["Key"]] = (int(item["Size"]), item["LastModified"].timestamp())
        return found

    def lease(self) -> dict[str, Any] | None:
        try:
            body = self.client.get_object(Bucket=self.server.bucket, Key=self.prefix + LEASE_NAME)
        except self.client.exceptions.NoSuchKey:
            return None
        result: dict[str, Any] = json.loads(body["Body"].read())
        return result


@pytest.fixture
def fleet(s3_server: SeaweedS3, tmp_path: Path) -> Any:
    f = Fleet(s3_server, tmp_path)
    yield f
    f.stop()


def _lags(put: dict[int, float], seen: dict[int, float]) -> list[float]:
    missing = sorted(set(put) - set(seen))
    assert not missing, f"blocks never found by the other engine: {missing}"
    return [seen[i] - put[i] for i in put]


def _figures(lags: list[float]) -> str:
    return f"median {statistics.median(lags):.2f}s, max {max(lags):.2f}s over {len(lags)} blocks"


def test_what_one_engine_stores_another_finds_within_the_stated_bound(fleet: Fleet) -> None:
    """Two engines at the same time, one writing and one looking (`contains`, as the
    manager's existence checks): single objects are found as soon as their put returned;
    blocks of a full pack within `pack_refresh` (1 s) and a listing; a block of a partial pack
    within `pack_after` (2 s) more. The figures are printed (pytest -s)."""
    single = fleet.add("single-w", mode="write", keys=[0, 20], interval=0.1)
    single_watch = fleet.add("single-r", mode="watch", keys=[0, 20], linger=30)
    packs = {"blocks_per_object": 4}
    full = fleet.add("full-w", mode="write", keys=[100, 132], interval=0.0, options=packs)
    full_watch = fleet.add("full-r", mode="watch", keys=[100, 132], linger=30, options=packs)
    fleet.start()
    fleet.wait()
    # The partial packs: one block every 1.2 s, a pack never fills.
    partial = fleet.add("partial-w", mode="write", keys=[200, 208], interval=1.2, options=packs)
    partial_watch = fleet.add("partial-r", mode="watch", keys=[200, 208], linger=40, options=packs)
    fleet.start()
    fleet.wait()

    single_lags = _lags(single.events("put"), single_watch.events("seen"))
    # A full pack is written once its 4th block is held: its blocks' lags from that put.
    put = full.events("put")
    pack_done = {i: put[i - (i - 100) % 4 + 3] for i in put}
    full_lags = _lags(pack_done, full_watch.events("seen"))
    partial_lags = _lags(partial.events("put"), partial_watch.events("seen"))
    print(
        f"\nvisibility: single objects {_figures(single_lags)};"
        f" full packs {_figures(full_lags)}; partial packs {_figures(partial_lags)}"
    )
    slack = 1.0  # a loaded 2-CPU machine: the write, the listing, the watcher's poll
    assert max(single_lags) <= slack
    assert max(full_lags) <= 1.0 + slack  # pack_refresh
    assert max(partial_lags) <= 2.0 + 1.0 + slack  # pack_after + pack_refresh


def test_a_writer_killed_loses_only_the_blocks_of_the_last_pack_after(
    fleet: Fleet, s3_server: SeaweedS3
) -> None:
    """kill -9 of an engine writing packs that never fill (256 blocks each, one block every
    0.1 s): every block whose put returned more than `pack_after` (2 s, the default) and a
    write before the kill is in the bucket, in a pack a fresh tier reads."""
    import asyncio

    from tiering.testing import key, payload
    from tiers.s3 import S3Tier

    writer = fleet.add(
        "writer", mode="write", keys=[0, 1000], interval=0.1, options={"blocks_per_object": 256}
    )
    fleet.start()
    time.sleep(6.5)
    writer.process.send_signal(signal.SIGKILL)
    killed = time.time()
    writer.process.wait()
    put = writer.events("put")
    old = sorted(i for i, t in put.items() if t < killed - 2.0 - 1.0)
    assert len(old) >= 20, put

    async def found() -> list[int]:
        async with S3Tier(
            namespace=NAMESPACE,
            bucket=s3_server.bucket,
            prefix=fleet.prefix,
            endpoint_url=s3_server.endpoint,
            access_key=s3_server.ACCESS_KEY,
            secret_key=s3_server.SECRET_KEY,
            blocks_per_object=256,
            read_only=True,
        ) as reader:
            return [i for i in old if await reader.get_bytes(key(i), 4096) == payload(4096, i)]

    assert asyncio.run(found()) == old
    packs = [n for n in fleet.listing() if "/packs/" in n]
    assert len(packs) >= 2  # written by pack_after, not by a full pack


def test_capacity_holds_with_three_writers_oldest_first_and_the_lease_moves(
    fleet: Fleet,
) -> None:
    """Three engines write into one prefix with `capacity` 1 MiB (two single objects, one
    packs of 4), at ~1.4 MiB/s together. One of them holds the lease and sweeps every 1 s;
    at every moment the objects older than `sweep_interval` and a pass (3 s) fit within the
    capacity, and each sweep removes objects older than every one it leaves. Killed, the
    holder's lease is taken by another writer within `LEASE_TTL` (4 s here) and a half, and the
    bound holds again."""
    capacity = 1 << 20
    common = {"capacity": capacity, "sweep_interval": 1.0}
    writers = [
        fleet.add(
            f"w{n}",
            mode="write",
            keys=[n * 10_000, n * 10_000 + 400],
            interval=0.1,
            size=48 << 10,
            lease_ttl=4.0,
            options=common | ({"blocks_per_object": 4, "pack_after": 1.0} if n == 2 else {}),
        )
        for n in range(3)
    ]
    fleet.start()
    window = 3.0
    snapshots: list[tuple[float, dict[str, tuple[int, float]]]] = []

    def watch(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            snapshots.append((time.time(), fleet.listing()))
            time.sleep(0.3)

    def check(since: float) -> None:
        for at, listing in snapshots:
            if at < since:
                continue
            old = sum(size for size, modified in listing.values() if modified < at - window)
            assert old <= capacity, (at - since, old, len(listing))
        for (_, before), (_, after) in zip(snapshots, snapshots[1:], strict=False):
            gone = [before[n][1] for n in before if n not in after]
            kept = [after[n][1] for n in before if n in after]
            if gone and kept:
                assert max(gone) <= min(kept), "a sweep removed a newer object than one it kept"

    watch(8.0)
    check(since=snapshots[0][0] + window + 2.0)  # the first pass after the lease is taken
    sweeping = [w for w in writers if w.counters().get("sweeps")]
    assert len(sweeping) == 1, [w.counters() for w in writers]
    lease = fleet.lease()
    assert lease is not None
    holder = sweeping[0]
    assert lease["holder"] == holder.state()["writer"] and lease["pid"] == holder.process.pid
    assert max(sum(s for s, _ in listing.values()) for _, listing in snapshots) > capacity

    holder.process.send_signal(signal.SIGKILL)
    holder.process.wait()
    killed = time.time()
    moved = None
    while time.time() < killed + 4.0 * 1.5 + 1.0 + 3.0:
        lease = fleet.lease()
        if lease is not None and lease["holder"] != holder.state()["writer"]:
            moved = time.time() - killed
            break
        time.sleep(0.2)
    assert moved is not None, "the lease never moved"
    print(f"\nthe lease moved {moved:.1f}s after its holder was killed")
    snapshots.clear()
    watch(6.0)
    check(since=killed + moved + window)
    others = [w for w in writers if w is not holder]
    assert sum(1 for w in others if w.counters().get("leases_taken")) == 1
    fleet.stop()


def test_engines_writing_the_same_blocks_at_once_write_each_once(fleet: Fleet) -> None:
    """Two engines put the same 60 single-object blocks at the same time: the server's
    conditional put lets exactly one write each, the other counts a duplicate. Then an engine
    putting blocks another engine packed (found by its refreshed index) packs none of them."""
    a = fleet.add("a", mode="write", keys=[0, 60], size=32 << 10)
    b = fleet.add("b", mode="write", keys=[0, 60], size=32 << 10)
    fleet.start()
    fleet.wait()
    counters = [a.counters(), b.counters()]
    assert sum(c.get("duplicates", 0) for c in counters) == 60, counters
    assert sum(c.get("bytes_written", 0) for c in counters) == 60 * (32 << 10), counters
    spans = [(min(w.events("put").values()), max(w.events("put").values())) for w in (a, b)]
    assert max(s for s, _ in spans) < min(e for _, e in spans), ("not at once", spans)

    packs = {"blocks_per_object": 4}
    first = fleet.add("packer", mode="write", keys=[100, 140], linger=8, options=packs)
    # The second engine starts with the first, and looks until its index has them all...
    watcher = fleet.add("watch", mode="watch", keys=[100, 140], linger=20, options=packs)
    fleet.start()
    deadline = time.monotonic() + 20
    while watcher.process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(watcher.events("seen")) == 40
    # ...then, while the first still runs, an engine whose index loads them puts them all.
    second = fleet.add("again", mode="write", keys=[100, 140], options=packs)
    fleet.start()
    second.process.wait(timeout=60)
    assert first.process.poll() is None, "the first engine ended before the second wrote"
    again = second.counters()
    assert again.get("duplicates") == 40 and not again.get("packs_written"), again
    fleet.wait()


def test_a_writer_whose_clock_is_behind_is_found_within_the_same_bound(fleet: Fleet) -> None:
    """An engine whose host clock is 10 minutes behind (S3's signatures accept 15) writes
    packs beside an engine looking for them: its packs are named by the server's clock (from
    its answers' Date), not its own, so they are found within `pack_refresh` as any other
    writer's."""
    packs = {"blocks_per_object": 4}
    writer = fleet.add(
        "skewed", mode="write", keys=[0, 16], interval=0.3, clock_skew=-600, options=packs
    )
    watcher = fleet.add("watch", mode="watch", keys=[0, 16], linger=30, options=packs)
    fleet.start()
    fleet.wait()
    put = writer.events("put")
    pack_done = {i: put[i - i % 4 + 3] for i in put}
    lags = _lags(pack_done, watcher.events("seen"))
    print(f"\nvisibility of a writer 10 minutes behind: {_figures(lags)}")
    assert max(lags) <= 1.0 + 1.0  # pack_refresh, and slack for a loaded machine


@pytest.mark.parametrize("forge", ["garbage", "replay"])
def test_with_a_secret_a_stranger_rewriting_the_lease_keeps_no_sweeper_off(
    fleet: Fleet, forge: str
) -> None:
    """A stranger process who can write the bucket rewrites every lease object under the
    prefix every second, with forged bodies or with the first genuine body it read, while an
    engine with `auth.secret` and `capacity` 256 KiB writes ~2.5 MiB: the engine takes a
    forged lease over at once (and counts it), its own lease written again by another is taken
    back, a replayed one lapses with the write it came from, so it sweeps all along: at every
    moment the objects older than `sweep_interval` and a pass fit within the capacity. Without
    the lease's MAC every rewrite held the sweep off one `LEASE_TTL`, for good."""
    from tiering.testing import SECRET

    capacity = 256 << 10
    writer = fleet.add(
        "writer",
        mode="write",
        keys=[0, 160],
        interval=0.05,
        size=16 << 10,
        lease_ttl=3.0,
        secret=SECRET.hex(),
        options={"capacity": capacity, "sweep_interval": 0.5},
    )
    stranger = fleet.add("stranger", mode="forge", forge=forge, interval=1.0, linger=30)
    start = fleet.start()
    window = 2.0
    worst = 0
    largest = 0
    while writer.process.poll() is None:
        at, listing = time.time(), fleet.listing()
        largest = max(largest, sum(size for size, _ in listing.values()))
        if at > start + window + 1.0:
            old = sum(size for size, modified in listing.values() if modified < at - window)
            worst = max(worst, old)
        time.sleep(0.3)
    assert writer.process.returncode == 0, writer.err.read_text()
    counters = writer.counters()
    rounds = len(stranger.lines("forged"))
    print(
        f"\n{forge} lease every 1 s ({rounds} rounds): objects older than {window:.0f}s at most"
        f" {worst / 1024:.0f} KiB, the prefix at most {largest / 1024:.0f} KiB, capacity"
        f" {capacity >> 10} KiB; {counters}"
    )
    assert rounds >= 5
    assert worst <= capacity, (worst, counters)
    assert counters.get("sweeps", 0) >= 5 and counters.get("swept", 0) >= 100, counters
    if forge == "garbage":
        assert counters.get("leases_forged", 0) >= 3, counters
    assert not counters.get("errors"), counters


def test_with_a_secret_a_peers_lease_is_honoured_and_another_secret_elects_its_own(
    fleet: Fleet,
) -> None:
    """Two engines with one secret and a third with another write one prefix with `capacity`:
    the first two elect one sweeper and neither takes the other's fresh lease over or counts
    it forged; the third, whose lease object is another (its name carries a label of its
    secret), elects itself and sweeps beside it, never contending for the first two's lease."""
    from tiering.testing import OTHER_SECRET, SECRET

    common = {"capacity": 256 << 10, "sweep_interval": 0.5}
    spec = {"mode": "write", "interval": 0.1, "size": 16 << 10, "lease_ttl": 3.0, "linger": 1.0}
    same = [
        fleet.add(
            f"s{n}", keys=[n * 1000, n * 1000 + 60], secret=SECRET.hex(), options=common, **spec
        )
        for n in range(2)
    ]
    other = fleet.add("o", keys=[5000, 5060], secret=OTHER_SECRET.hex(), options=common, **spec)
    fleet.start()
    fleet.wait()
    counters = [w.counters() for w in (*same, other)]
    assert sum(1 for c in counters[:2] if c.get("sweeps")) == 1, counters
    assert sum(c.get("leases_taken", 0) for c in counters[:2]) == 1, counters
    assert other.counters().get("sweeps") and other.counters().get("leases_taken") == 1
    for c in counters:
        assert not c.get("leases_forged") and not c.get("lease_lost"), counters


def test_engines_reading_at_once_each_write_their_record_and_the_sweeper_keeps_all_they_read(
    fleet: Fleet,
) -> None:
    """Blocks 0-9 written, 0-4 a second before 5-9; two engine processes read at once, one 0
    and 1, the other 2 and 3, three rounds each, writing their records of reads every 0.3 s.
    Each writes a record of its own (neither overwrites the other), and a sweeper with room
    for four and a half objects keeps 0-3 (read last by one or the other), where write order
    keeps 6-9."""

    async def fill() -> int:
        async with s3_tier(fleet.server, fleet.prefix) as writer:
            for i in range(10):
                if i == 5:
                    await asyncio.sleep(1.1)
                await writer.put(key(i), payload(4096, i))
            return max(size for size, _ in fleet.listing().values())

    size = asyncio.run(fill())
    time.sleep(1.1)
    reading = {"capacity": 1 << 30, "reads_interval": 0.3}
    first = fleet.add("a", mode="read", keys=[0, 2], rounds=3, interval=0.2, options=reading)
    second = fleet.add("b", mode="read", keys=[2, 4], rounds=3, interval=0.2, options=reading)
    fleet.start()
    fleet.wait()
    assert len(first.events("got")) == len(second.events("got")) == 2
    for worker in (first, second):
        assert worker.counters()["reads_records_written"] >= 2, worker.counters()

    async def sweep() -> tuple[list[int], list[str]]:
        async with s3_tier(fleet.server, fleet.prefix, capacity=size * 9 // 2) as tier:
            assert tier._sweeper is not None
            for _ in range(4):
                if not await tier._sweeper.sweep():
                    break
            found = await tier.contains([key(i) for i in range(10)])
            return [i for i in range(10) if found[i]], await tier.list_records("reads.")

    kept, records = asyncio.run(sweep())
    assert kept == [0, 1, 2, 3], kept
    writers = {first.state()["writer"], second.state()["writer"]}
    assert {name.removeprefix("reads.") for name in records} == writers
